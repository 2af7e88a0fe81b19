//! Consumer groups (queues): a group is a durable cursor over one stream shard, served by
//! the core that owns the shard.
//!
//! - [`tracker`]: one group's state, sans-IO (claims, owed records, the cursor, dead
//!   letters), with time passed in.
//! - Group events live in the stream shard's own log, as `Group` batches (every group's
//!   acks, dead letters, redrives, discards, seeks, deletes): replicated, fenced and
//!   recovered with the shard, skipped by readers of the data. An event is durable (and
//!   on a Quorum shard held by a majority) before its request is answered; the shard's
//!   groups are built by folding those batches the first time a leader serves a group
//!   request, and dropped whenever it starts or stops leading.
//! - Group snapshots bound that fold: once [`Limits::snapshot_every_bytes`] of log were
//!   written since the last one, the leader writes the durable state of every group
//!   (what folding the events before it builds) as one record of a `Group` batch. A fold
//!   starts from the newest snapshot (looked for from the newest segment back) and
//!   applies only the events after it; a full fold passes snapshots over.
//! - [`GroupShard::serve`]: one request against the stream shard and its groups.
//!
//! Claims are memory only: after a restart or a failover, unsettled records go out again
//! (at-least-once); a live re-pin between cores hands them to the new core with the
//! shard (`core/moves.rs`). See `docs/queues.md`.

pub mod tracker;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use felix_core_runtime::task;
use felix_storage_uring::{Appended, BatchKind, ReadBatch};
use felix_wire::Offset;
use felix_wire::message::{GroupRecord, StartPosition};

use crate::error::BrokerError;
use crate::shard::StreamShard;
pub use tracker::Member;
use tracker::{Claimed, Durable, Event, Limits, Refusal, Tracker};

/// Longest group name.
pub const GROUP_NAME_MAX_BYTES: usize = 128;
/// Groups one stream shard may hold.
pub const GROUPS_PER_SHARD_MAX: usize = 1024;
/// Longest a poll may wait for records.
pub const POLL_WAIT_MAX: Duration = Duration::from_secs(30);
/// A waiting poll looks again at least this often (lapsed claims, delayed nacks).
const POLL_RECHECK: Duration = Duration::from_millis(100);
/// Payload bytes one poll answer carries at most (it always carries one record).
const POLL_BYTES_MAX: usize = 4 << 20;
/// The longest a repeated ack waits for the first ack's write before it is answered
/// `not_ready` (retryable).
const ACK_RETRY_WAIT_MAX: Duration = Duration::from_secs(30);
/// Offsets one backward read for a record's `skipped_before` covers at most.
const LOOK_BACK_WINDOW_MAX: u64 = 256;
/// Group records a build keeps in memory while it looks back for a snapshot (bytes,
/// with their bookkeeping); past it the fold reads the log forward again instead.
const FOLD_KEPT_BYTES_MAX: usize = 64 << 20;

/// A group request, for the core that owns the shard.
#[derive(Debug, Clone)]
pub enum GroupOp {
    /// Claim up to `max` records, waiting up to `wait_ms` for some to appear.
    Poll {
        /// Group.
        group: String,
        /// Record cap.
        max: u32,
        /// Long-poll wait.
        wait_ms: u64,
        /// Claim visibility (0 = the default).
        visibility_ms: u64,
        /// The named member polling (`consumer`, `reclaim`), if any.
        member: Option<Member>,
    },
    /// Finish a record.
    Ack(String, u64),
    /// Hand a record back: group, offset, `delay_ms` before it is owed again, and the
    /// attempt nacked (0: whichever).
    Nack(String, u64, u64, u32),
    /// Extend a claim: group, offset, attempts, extension.
    Extend(String, u64, u32, u64),
    /// Give up on a claimed record.
    DeadLetter(String, u64),
    /// List dead letters.
    DeadLetters(String),
    /// Drop a dead letter.
    Discard(String, u64),
    /// Make a dead letter owed again.
    Redrive(String, u64),
    /// Place (or create) the cursor.
    Seek {
        /// Group.
        group: String,
        /// Where.
        start: StartPosition,
        /// Only when the group does not exist.
        if_new: bool,
    },
    /// Describe.
    Describe(String),
    /// Delete.
    Delete(String),
}

impl GroupOp {
    /// The group named.
    pub fn group(&self) -> &str {
        match self {
            GroupOp::Poll { group, .. } | GroupOp::Seek { group, .. } => group,
            GroupOp::Ack(g, _)
            | GroupOp::Nack(g, _, _, _)
            | GroupOp::Extend(g, _, _, _)
            | GroupOp::DeadLetter(g, _)
            | GroupOp::DeadLetters(g)
            | GroupOp::Discard(g, _)
            | GroupOp::Redrive(g, _)
            | GroupOp::Describe(g)
            | GroupOp::Delete(g) => g,
        }
    }

    /// Whether it changes its group only once its event is durable (a seek, a delete,
    /// a redrive, a discard): such a request must run to its end once written, even if
    /// the client goes away, or the trackers would lack an event the log holds.
    /// Whether the request writes an event whenever it is served (a poll writes only
    /// the dead letters its claims lead to): held back while a snapshot waits for the
    /// writes in flight ([`GroupShard::snapshot_for_retention`]).
    fn writes_first(&self) -> bool {
        matches!(
            self,
            GroupOp::Ack(..)
                | GroupOp::DeadLetter(..)
                | GroupOp::Discard(..)
                | GroupOp::Redrive(..)
                | GroupOp::Seek { .. }
                | GroupOp::Delete(_)
        )
    }

    pub fn applies_after_write(&self) -> bool {
        matches!(
            self,
            GroupOp::Seek { .. } | GroupOp::Delete(_) | GroupOp::Discard(..) | GroupOp::Redrive(..)
        )
    }
}

/// The answer to a group request.
#[derive(Debug, Clone)]
pub enum GroupAnswer {
    /// Claimed records (possibly none).
    Records(Vec<GroupRecord>),
    /// A settle was applied (answered `cache_ok`).
    Done,
    /// The claim's granted visibility.
    Extended(u64),
    /// Dead letters, lowest first.
    DeadLetters(Vec<u64>),
    /// The cursor after a seek, and whether it moved.
    Position(u64, bool),
    /// Counts.
    Info {
        /// Cursor, `None` for a group that does not exist.
        committed: Option<u64>,
        /// The shard's tail.
        tail: u64,
        /// Claims.
        in_flight: u64,
        /// Owed.
        owed: u64,
        /// Dead letters.
        dead_letters: u64,
    },
    /// Whether the deleted group existed.
    Deleted(bool),
}

/// Checks a group name.
pub fn check_name(group: &str) -> Result<(), BrokerError> {
    if group.is_empty() || group.len() > GROUP_NAME_MAX_BYTES {
        return Err(BrokerError::InvalidRequest(format!(
            "a group name is 1 to {GROUP_NAME_MAX_BYTES} bytes"
        )));
    }
    if group.chars().any(char::is_control) {
        return Err(BrokerError::InvalidRequest(
            "a group name has no control characters".into(),
        ));
    }
    Ok(())
}

/// Wakes the tasks waiting for a change.
///
/// A waiter that gives up (a poll's or a watch's timeout dropped its future) takes its
/// waker out again: a list only [`Wakers::wake_all`] emptied grew by one waker, and the
/// finished task it holds, with every timed-out long poll on a stream or group that
/// changed no more.
#[derive(Debug, Default)]
pub struct Wakers {
    slots: RefCell<Slots>,
    changes: Cell<u64>,
}

/// The waiting wakers, each in the slot its future remembers.
#[derive(Debug, Default)]
struct Slots {
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Wakers {
    /// Wakes every waiter.
    pub fn wake_all(&self) {
        self.changes.set(self.changes.get() + 1);
        let mut slots = self.slots.borrow_mut();
        if slots.wakers.is_empty() {
            return;
        }
        slots.free.clear();
        for w in slots.wakers.drain(..).flatten() {
            w.wake();
        }
    }

    /// Resolves at the next [`Wakers::wake_all`].
    pub fn changed(&self) -> Changed<'_> {
        Changed {
            wakers: self,
            seen: self.changes.get(),
            slot: None,
        }
    }

    /// How many waiters are registered.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.slots.borrow().wakers.iter().flatten().count()
    }
}

/// The future of [`Wakers::changed`]; dropped before it resolves, it unregisters.
#[derive(Debug)]
pub struct Changed<'a> {
    wakers: &'a Wakers,
    seen: u64,
    /// Its slot, valid while no `wake_all` has run since (which empties every slot).
    slot: Option<usize>,
}

impl Future for Changed<'_> {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if this.wakers.changes.get() != this.seen {
            this.slot = None;
            return Poll::Ready(());
        }
        let mut slots = this.wakers.slots.borrow_mut();
        let waker = Some(cx.waker().clone());
        match this.slot {
            Some(i) => slots.wakers[i] = waker,
            None => {
                let i = match slots.free.pop() {
                    Some(i) => {
                        slots.wakers[i] = waker;
                        i
                    }
                    None => {
                        slots.wakers.push(waker);
                        slots.wakers.len() - 1
                    }
                };
                this.slot = Some(i);
            }
        }
        Poll::Pending
    }
}

impl Drop for Changed<'_> {
    fn drop(&mut self) {
        // After a `wake_all` the slots were emptied and may hold other waiters now.
        if let Some(i) = self.slot
            && self.wakers.changes.get() == self.seen
        {
            let mut slots = self.wakers.slots.borrow_mut();
            slots.wakers[i] = None;
            slots.free.push(i);
        }
    }
}

const KIND_ACK: u8 = 1;
const KIND_DEAD: u8 = 2;
const KIND_REDRIVE: u8 = 3;
const KIND_DISCARD: u8 = 4;
const KIND_SEEK: u8 = 5;
const KIND_DELETE: u8 = 6;
const KIND_SNAPSHOT: u8 = 7;

/// Dead letters one `group_dead_letters` answer lists, lowest first (about 1 MiB of
/// JSON): the rest show as those are discarded or redriven. All of them made an answer
/// past the SDK's 16 MiB frame once a group held some 1.5 million, and the list could
/// never be read.
const DEAD_LETTERS_LISTED_MAX: usize = 100_000;

/// Version of the snapshot record's layout: 2 since the finished records ahead of the
/// cursor are runs (version 1, read still, listed each offset).
const SNAPSHOT_VERSION: u8 = 2;
/// The largest snapshot a leader writes: a larger state is not snapshotted (the next
/// fold starts from the snapshot before, or the log's base).
const SNAPSHOT_MAX_BYTES: usize = 256 << 10;

/// A group event record (one record of a `Group` batch): `u8 kind, u8 group length, group, u64 offset` (big-endian).
/// `None` is a delete of the group.
fn encode(group: &str, event: Option<Event>) -> Bytes {
    let (kind, offset) = match event {
        Some(Event::Ack(o)) => (KIND_ACK, o),
        Some(Event::Dead(o)) => (KIND_DEAD, o),
        Some(Event::Redrive(o)) => (KIND_REDRIVE, o),
        Some(Event::Discard(o)) => (KIND_DISCARD, o),
        Some(Event::Seek(o)) => (KIND_SEEK, o),
        None => (KIND_DELETE, 0),
    };
    let mut b = BytesMut::with_capacity(10 + group.len());
    b.put_u8(kind);
    b.put_u8(group.len() as u8);
    b.put_slice(group.as_bytes());
    b.put_u64(offset);
    b.freeze()
}

/// A group snapshot record: `u8 kind (7), u8 version (2), u32 groups`, then per group
/// (by name) `u8 name length, name, u64 committed, u64 high water`, the records owed by
/// a redrive (`u32 count, count x u64`), the finished records ahead of the cursor as
/// runs (`u32 count, count x (u64 start, u64 end)`, end exclusive), and the dead
/// letters (`u32 count, count x u64`), big-endian. `None` past [`SNAPSHOT_MAX_BYTES`].
/// (Version 1 listed the finished records ahead one offset each.)
fn encode_snapshot(groups: &HashMap<String, Tracker>) -> Option<Bytes> {
    let mut names: Vec<&String> = groups.keys().collect();
    names.sort_unstable();
    let mut b = BytesMut::with_capacity(6 + 64 * names.len());
    b.put_u8(KIND_SNAPSHOT);
    b.put_u8(SNAPSHOT_VERSION);
    b.put_u32(names.len() as u32);
    for name in names {
        let d = groups[name].durable();
        b.put_u8(name.len() as u8);
        b.put_slice(name.as_bytes());
        b.put_u64(d.committed);
        b.put_u64(d.high_water);
        b.put_u32(d.owed.len() as u32);
        d.owed.iter().for_each(|o| b.put_u64(*o));
        b.put_u32(d.settled_ahead.len() as u32);
        for (start, end) in &d.settled_ahead {
            b.put_u64(*start);
            b.put_u64(*end);
        }
        b.put_u32(d.dead.len() as u32);
        d.dead.iter().for_each(|o| b.put_u64(*o));
        if b.len() > SNAPSHOT_MAX_BYTES {
            return None;
        }
    }
    Some(b.freeze())
}

fn decode_snapshot(mut r: Bytes, limits: Limits) -> Option<HashMap<String, Tracker>> {
    if r.len() < 6 || r.get_u8() != KIND_SNAPSHOT {
        return None;
    }
    let version = r.get_u8();
    if !(1..=SNAPSHOT_VERSION).contains(&version) {
        return None;
    }
    let n = r.get_u32();
    let mut groups = HashMap::new();
    // `count` values of `width` u64s each.
    let list = |r: &mut Bytes, width: usize| -> Option<Vec<u64>> {
        if r.len() < 4 {
            return None;
        }
        let count = r.get_u32() as usize;
        let values = count.checked_mul(width)?;
        if r.len() < values.checked_mul(8)? {
            return None;
        }
        Some((0..values).map(|_| r.get_u64()).collect())
    };
    for _ in 0..n {
        let len = usize::from(*r.first()?);
        r.advance(1);
        if r.len() < len + 16 {
            return None;
        }
        let name = String::from_utf8(r.split_to(len).to_vec()).ok()?;
        let (committed, high_water) = (r.get_u64(), r.get_u64());
        let owed = list(&mut r, 1)?;
        let settled_ahead = if version == 1 {
            list(&mut r, 1)?
                .into_iter()
                .map(|o| o.checked_add(1).map(|end| (o, end)))
                .collect::<Option<Vec<_>>>()?
        } else {
            let flat = list(&mut r, 2)?;
            let runs: Vec<(u64, u64)> = flat.chunks_exact(2).map(|p| (p[0], p[1])).collect();
            if runs.iter().any(|(start, end)| start >= end) {
                return None;
            }
            runs
        };
        let dead = list(&mut r, 1)?;
        let d = Durable {
            committed,
            high_water,
            owed,
            settled_ahead,
            dead,
        };
        groups.insert(name, Tracker::from_durable(d, limits));
    }
    r.is_empty().then_some(groups)
}

pub(crate) fn is_snapshot(r: &[u8]) -> bool {
    r.first() == Some(&KIND_SNAPSHOT)
}

/// Applies one group event record to folded state, as every fold does (a group first
/// named by an event starts at offset 0; `None` deletes it).
fn fold_event(
    groups: &mut HashMap<String, Tracker>,
    group: &str,
    event: Option<Event>,
    limits: Limits,
) {
    match event {
        None => {
            groups.remove(group);
        }
        Some(e) => match groups.get_mut(group) {
            Some(t) => t.apply(e),
            None => {
                let mut t = Tracker::new(0, limits);
                t.apply(e);
                groups.insert(group.to_owned(), t);
            }
        },
    }
}

fn decode(mut r: Bytes) -> Option<(String, Option<Event>)> {
    if r.len() < 2 {
        return None;
    }
    let kind = r.get_u8();
    let len = usize::from(r.get_u8());
    if r.len() != len + 8 {
        return None;
    }
    let group = String::from_utf8(r.split_to(len).to_vec()).ok()?;
    let o = r.get_u64();
    let event = match kind {
        KIND_ACK => Some(Event::Ack(o)),
        KIND_DEAD => Some(Event::Dead(o)),
        KIND_REDRIVE => Some(Event::Redrive(o)),
        KIND_DISCARD => Some(Event::Discard(o)),
        KIND_SEEK => Some(Event::Seek(o)),
        KIND_DELETE => None,
        _ => return None,
    };
    Some((group, event))
}

/// Appends group events to the stream shard's log (the owning core's write path).
pub type GroupWriter = Box<
    dyn Fn(Vec<Bytes>) -> std::pin::Pin<Box<dyn Future<Output = Result<Appended, BrokerError>>>>,
>;

/// Whether this core may still hand out claims from the groups (it leads the shard and
/// holds its lease): `Err` with the refusal once it may not.
pub type LeadCheck = Box<dyn Fn() -> Result<(), BrokerError>>;

/// The groups of one stream shard, on its owning core while it leads.
pub struct GroupShard {
    writer: GroupWriter,
    groups: RefCell<HashMap<String, Tracker>>,
    limits: Limits,
    /// Woken when records become owed (a nack, a redrive, a failed ack write) or room
    /// frees under the in-flight cap: waiting polls look again.
    settled: Wakers,
    /// Woken when an ack's write ends (repeated acks wait for it).
    acks_written: Wakers,
    /// Dead letters whose write is in flight (group, offset): a consumer's dead letter
    /// sent again meanwhile waits for it (woken through `acks_written`) rather than
    /// being answered done on the strength of a write that may yet fail.
    dead_writing: RefCell<std::collections::HashSet<(String, u64)>>,
    /// Groups with a seek, create or delete handed to the writer and not yet applied
    /// to their trackers, and how many. Those changes apply once durable; an ack,
    /// claim or dead letter applies at once and writes after. Were one to run in
    /// between, the trackers would take the two in the opposite order to the log, and
    /// the next build would differ from them: an ack written after a delete brought
    /// the deleted group back, at offset 0. So every request of the group waits for
    /// such a change first ([`GroupShard::after_changes`]).
    changing: RefCell<HashMap<String, usize>>,
    /// Woken when a change in `changing` ends.
    changes_applied: Wakers,
    /// What folding the log up to the last event written builds: events are applied
    /// here as they are handed to the writer, which claims their offsets in that same
    /// order, so a snapshot taken from it holds exactly the events before its own
    /// offset. `None` once a write failed (the log may lack an event applied here): no
    /// more snapshots until the groups are built again.
    folded: Rc<RefCell<Option<HashMap<String, Tracker>>>>,
    /// The log's size when the last snapshot was written (or what the build read).
    snapshot_mark: Cell<u64>,
    /// The log's first offset when the last snapshot came due.
    snapshot_base: Cell<u64>,
    /// Group event writes handed to the writer and not yet answered. A snapshot waits
    /// for none: a write that failed (its offset given back, or refused at admission)
    /// is only seen failed once its answer comes, and a snapshot taken before that
    /// would hold an event the log lacks.
    pending: Rc<Cell<usize>>,
    /// A snapshot came due while writes were pending: the log's size then, taken when
    /// the last of them is answered.
    deferred: Rc<Cell<Option<u64>>>,
    /// Snapshots started since [`GroupShard::take_snapshots`] last asked.
    started: Cell<u64>,
    /// Set when the shard's groups were dropped (a leadership change): a request still
    /// running on this state (a waiting poll) must write nothing more, or the groups
    /// built next would miss its events.
    retired: Cell<bool>,
    /// Looked at before every pass of a waiting poll (set by the core): a poll that
    /// began on the leader must not go on claiming, for up to its whole wait, on a
    /// broker that was deposed or lost its lease meanwhile, while the new leader hands
    /// the same records to other consumers.
    lead_check: RefCell<Option<LeadCheck>>,
    /// How the groups were built, for metrics.
    built: Built,
    /// Offsets just above a record known to hold none, from the reads and writes the
    /// groups make anyway: a poll's first record's `skipped_before` without a read.
    known_empty: Rc<Cell<KnownEmpty>>,
    /// A claim found no room under the shard's bound on claims (every group's): the
    /// next settle wakes the waiting polls, as one of a full group does.
    at_shard_bound: Cell<bool>,
    /// Set while a snapshot retention asked for waits for the group writes in flight
    /// ([`GroupShard::snapshot_for_retention`]): requests arriving meanwhile wait
    /// before they touch the groups.
    quiet: Cell<bool>,
    /// Woken when `quiet` ends.
    quiet_ended: Wakers,
}

/// Two stretches of the shard's log, one right above the other: offsets known to hold
/// records, then offsets known to hold none for consumers (either may be empty; both
/// empty at 0 say that nothing lies below the log's start).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct KnownEmpty {
    /// Every offset in `records..from` holds a record.
    records: u64,
    /// Every offset in `from..to` holds none.
    from: u64,
    /// One past the known stretch without records.
    to: u64,
}

impl KnownEmpty {
    /// A batch over `base..end` was seen, holding records or not.
    fn saw(self, base: u64, end: u64, records: bool) -> KnownEmpty {
        match records {
            // Joined to the records known when it reaches them (a batch holds records
            // or none, so it cannot overlap the stretch without).
            true if end > self.from => KnownEmpty {
                records: if base <= self.from {
                    base.min(self.records)
                } else {
                    base
                },
                from: end,
                to: end,
            },
            false if base >= self.from && base <= self.to && end > self.to => {
                KnownEmpty { to: end, ..self }
            }
            _ => self,
        }
    }

    /// How many offsets right below `at` hold no record, when that is known.
    fn below(self, at: u64) -> Option<u64> {
        if self.records < at && at <= self.from {
            Some(0)
        } else {
            (self.from <= at && at <= self.to).then(|| at - self.from)
        }
    }
}

/// An ack's write in flight: marked in its tracker until it ends (answered, failed, or
/// the request dropped), then repeated acks of the offset are woken.
struct AckWriting<'a> {
    shard: &'a GroupShard,
    group: &'a str,
    o: u64,
    /// The write was answered and succeeded ([`AckWriting::end`]).
    ok: bool,
}

impl<'a> AckWriting<'a> {
    /// The ack of `o` was just settled by [`Tracker::ack`] (which marked it written).
    fn start(shard: &'a GroupShard, group: &'a str, o: u64) -> Self {
        AckWriting {
            shard,
            group,
            o,
            ok: false,
        }
    }

    /// The write ended: `ok`, or it failed and the record is owed again.
    fn end(mut self, ok: bool) {
        self.ok = ok;
    }
}

impl Drop for AckWriting<'_> {
    fn drop(&mut self) {
        // Not ok: failed, or the request went away mid-write and the write's fate is
        // unseen. Owed again (at least once), so a retry writes the ack itself rather
        // than being told "acked" on the strength of an unknown write.
        let ok = self.ok;
        self.shard
            .tracker(self.group, |t| t.ack_written(self.o, ok));
        self.shard.acks_written.wake_all();
        if !ok {
            // Owed again: waiting polls may take it.
            self.shard.settled.wake_all();
        }
    }
}

/// The claims a poll made and has not yet answered with, handed back (owed again, their
/// attempt not counted) if it goes away first: its request cancelled with the
/// connection, or a read failing part way. Left claimed, each lapsed only at its
/// visibility with an attempt counted for a delivery nobody got (five such and a record
/// never delivered was a dead letter).
struct Unanswered<'a> {
    shard: &'a GroupShard,
    group: &'a str,
    /// `(offset, claim pass)` of each.
    claims: Vec<(u64, u64)>,
}

impl Unanswered<'_> {
    /// The poll answers with them (or handed back those it could not deliver itself).
    fn answered(mut self) {
        self.claims.clear();
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.claims.is_empty() {
            return;
        }
        let claims = std::mem::take(&mut self.claims);
        self.shard.tracker(self.group, |t| {
            claims.iter().for_each(|&(o, serial)| t.release(o, serial))
        });
        self.shard.settled.wake_all();
    }
}

/// Dead letters being written, marked in [`GroupShard::dead_writing`] until the write
/// ends however it ends (answered, or the request dropped); then those waiting are woken.
struct DeadWriting<'a> {
    shard: &'a GroupShard,
    keys: Vec<(String, u64)>,
}

impl<'a> DeadWriting<'a> {
    fn start(shard: &'a GroupShard, group: &str, offsets: &[u64]) -> Self {
        let keys: Vec<(String, u64)> = offsets.iter().map(|o| (group.to_owned(), *o)).collect();
        shard.dead_writing.borrow_mut().extend(keys.iter().cloned());
        DeadWriting { shard, keys }
    }
}

impl Drop for DeadWriting<'_> {
    fn drop(&mut self) {
        let mut writing = self.shard.dead_writing.borrow_mut();
        self.keys.iter().for_each(|k| {
            writing.remove(k);
        });
        drop(writing);
        self.shard.acks_written.wake_all();
    }
}

/// A seek, create or delete of a group, from before its event is handed to the writer
/// until it is applied to the trackers or abandoned ([`GroupShard::changing`]).
struct Changing<'a> {
    shard: &'a GroupShard,
    group: String,
}

impl<'a> Changing<'a> {
    fn start(shard: &'a GroupShard, group: &str) -> Self {
        *shard
            .changing
            .borrow_mut()
            .entry(group.to_owned())
            .or_default() += 1;
        Changing {
            shard,
            group: group.to_owned(),
        }
    }
}

impl Drop for Changing<'_> {
    fn drop(&mut self) {
        let mut changing = self.shard.changing.borrow_mut();
        if let Some(n) = changing.get_mut(&self.group) {
            *n -= 1;
            if *n == 0 {
                changing.remove(&self.group);
            }
        }
        drop(changing);
        self.shard.changes_applied.wake_all();
    }
}

/// A group event write handed to the writer, counted in [`GroupShard::pending`] until
/// answered. Failed (or dropped unanswered: its outcome unknown), it ends snapshots
/// until the groups are built again: the events-only copy may hold an event the log
/// lacks.
struct Settle {
    pending: Rc<Cell<usize>>,
    deferred: Rc<Cell<Option<u64>>>,
    folded: Rc<RefCell<Option<HashMap<String, Tracker>>>>,
    ok: bool,
}

impl Drop for Settle {
    fn drop(&mut self) {
        self.pending.set(self.pending.get() - 1);
        if !self.ok {
            self.deferred.set(None);
            if self.folded.borrow_mut().take().is_some() {
                tracing::warn!(
                    "a group event write failed: no more group snapshots on this shard until its groups are built again"
                );
            }
        }
    }
}

/// How [`GroupShard::snapshot_for_retention`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetentionSnapshot {
    /// Handed to the writer.
    Written,
    /// The groups were dropped (a leadership change).
    Retired,
    /// A group write failed: no snapshot until the groups are built again.
    Stopped,
    /// The state is past [`SNAPSHOT_MAX_BYTES`].
    TooLarge,
    /// The group writes in flight did not end within [`QUIET_WAIT_MAX`], or this core
    /// may not write for the groups now.
    Busy,
}

/// The longest group requests wait for a snapshot retention asked for.
const QUIET_WAIT_MAX: Duration = Duration::from_millis(500);

/// Holds new group requests back while it lives ([`GroupShard::snapshot_for_retention`]).
struct Quiet<'a>(&'a GroupShard);

impl<'a> Quiet<'a> {
    fn start(groups: &'a GroupShard) -> Self {
        groups.quiet.set(true);
        Quiet(groups)
    }
}

impl Drop for Quiet<'_> {
    fn drop(&mut self) {
        self.0.quiet.set(false);
        self.0.quiet_ended.wake_all();
    }
}

/// Folds of the log one [`GroupShard::build`] tries when retention removes a segment
/// under it.
const BUILD_TRIES: usize = 3;

/// How [`GroupShard::build`] went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Built {
    /// The offset of the snapshot the fold started from.
    pub from_snapshot: Option<u64>,
    /// Bytes of records read: looking for the snapshot and folding after it.
    pub read_bytes: u64,
}

/// A shard's groups as one core hands them to another (a live re-pin).
#[derive(Debug, Clone)]
pub struct GroupState {
    trackers: HashMap<String, Tracker>,
    folded: Option<HashMap<String, Tracker>>,
    snapshot_mark: u64,
}

impl std::fmt::Debug for GroupShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupShard")
            .field("groups", &self.groups.borrow().len())
            .finish()
    }
}

impl GroupShard {
    /// Folds the `Group` batches of `stream`'s log into trackers, from the newest group
    /// snapshot on (or from the base when there is none); later events go through
    /// `writer`.
    ///
    /// One pass: segments are read from the newest back until one holds a snapshot this
    /// build can read, and the group records met on the way are kept (copied out of the
    /// read: a few dozen bytes each), so the fold after the snapshot reads nothing
    /// again. Only past [`FOLD_KEPT_BYTES_MAX`] of kept records does it read forward
    /// from the snapshot a second time.
    pub async fn build(
        stream: &StreamShard,
        limits: Limits,
        writer: GroupWriter,
    ) -> Result<Self, BrokerError> {
        Self::build_keeping(stream, limits, writer, FOLD_KEPT_BYTES_MAX).await
    }

    /// [`GroupShard::build`], keeping at most `keep_max` bytes of group records.
    ///
    /// Retention may remove a segment the build has listed but not read yet, only
    /// once a newer snapshot lies past it (`CoreBroker::group_floor`), so a build that
    /// meets a removed segment starts again from the log as it is now, a few times,
    /// rather than fail every group request.
    async fn build_keeping(
        stream: &StreamShard,
        limits: Limits,
        writer: GroupWriter,
        keep_max: usize,
    ) -> Result<Self, BrokerError> {
        let mut tries = 0;
        let (state, built) = loop {
            tries += 1;
            match Self::fold_log(stream, limits, keep_max).await {
                Err(BrokerError::Cursor { .. }) if tries < BUILD_TRIES => continue,
                other => break other?,
            }
        };
        let mut shard = Self::from_state(state, limits, writer);
        shard.built = built;
        Ok(shard)
    }

    /// The groups folded from the log (see [`GroupShard::build`]).
    async fn fold_log(
        stream: &StreamShard,
        limits: Limits,
        keep_max: usize,
    ) -> Result<(GroupState, Built), BrokerError> {
        let base = stream.log.base_offset();
        let end = stream.log.committed_end();
        let (mut groups, mut from_snapshot) = (HashMap::new(), None);
        // Each segment's group records, newest segment first; `None` once over the cap.
        let mut kept: Option<Vec<Vec<(u64, Bytes)>>> = Some(Vec::new());
        let mut kept_bytes = 0usize;
        let mut snapshots_readable = true;
        let mut until = end;
        // Bytes read, and of them the bytes of records after where the fold starts.
        let (mut read_bytes, mut after) = (0u64, 0u64);
        for segment in stream.log.segment_bases().into_iter().rev() {
            let from = segment.max(base);
            if from < until {
                let mut records = Vec::new();
                let mut keep_all = kept.is_some();
                let mut kept_here = kept_bytes;
                // Bytes of this segment's records after its newest snapshot.
                let mut since = 0u64;
                let read = walk(stream, from, until, |b| {
                    if b.kind != BatchKind::Group {
                        since += b.records.iter().map(|r| r.len() as u64).sum::<u64>();
                        return Ok(());
                    }
                    for (i, r) in b.records.into_iter().enumerate() {
                        let at = b.base_offset + i as u64;
                        let snapshot = is_snapshot(&r);
                        since = if snapshot { 0 } else { since + r.len() as u64 };
                        if at < until && (keep_all || snapshot) {
                            kept_here += r.len() + 48;
                            records.push((at, Bytes::copy_from_slice(&r)));
                            if keep_all && kept_here > keep_max {
                                // Over the cap: only snapshots from here on.
                                keep_all = false;
                                records.retain(|(_, r)| is_snapshot(r));
                            }
                        }
                    }
                    Ok(())
                })
                .await?;
                read_bytes += read;
                let newest = records
                    .iter()
                    .rposition(|(_, r)| snapshots_readable && is_snapshot(r));
                if let Some(i) = newest {
                    match decode_snapshot(records[i].1.clone(), limits) {
                        Some(state) => {
                            groups = state;
                            from_snapshot = Some(records[i].0);
                            records.drain(..=i);
                            after += since;
                        }
                        None => {
                            tracing::warn!(shard = %stream.key, offset = records[i].0, "a group snapshot it cannot read: folding the whole log");
                            snapshots_readable = false;
                        }
                    }
                }
                if from_snapshot.is_none() {
                    after += read;
                }
                match kept.as_mut() {
                    Some(k) if keep_all => {
                        kept_bytes = kept_here;
                        k.push(records);
                    }
                    _ => kept = None,
                }
                if from_snapshot.is_some() {
                    break;
                }
            }
            until = until.min(from);
            if from <= base {
                break;
            }
        }
        let mut fold = |at: u64, r: Bytes| -> Result<(), BrokerError> {
            if is_snapshot(&r) {
                return Ok(());
            }
            let (group, event) = decode(r).ok_or_else(|| unreadable(stream, at))?;
            fold_event(&mut groups, &group, event, limits);
            Ok(())
        };
        match kept {
            Some(segments) => {
                for (at, r) in segments.into_iter().rev().flatten() {
                    fold(at, r)?;
                }
            }
            None => {
                let start = from_snapshot.map_or(base, |at| at + 1);
                read_bytes += walk(stream, start, end, |b| {
                    if b.kind == BatchKind::Group {
                        for (i, r) in b.records.into_iter().enumerate() {
                            fold(b.base_offset + i as u64, r)?;
                        }
                    }
                    Ok(())
                })
                .await?;
            }
        }
        // Claims are not logged: what the log held may have been handed out already.
        for t in groups.values_mut() {
            t.inherit_below(end);
        }
        Ok((
            GroupState {
                folded: Some(groups.clone()),
                trackers: groups,
                snapshot_mark: stream.log.written_bytes().saturating_sub(after),
            },
            Built {
                from_snapshot,
                read_bytes,
            },
        ))
    }

    /// The groups as another core left them (a live re-pin hands them over with the
    /// shard): their cursors, dead letters, and the claims in flight, so a record claimed
    /// before the move is not handed to a second consumer after it.
    pub fn from_state(state: GroupState, limits: Limits, writer: GroupWriter) -> Self {
        GroupShard {
            writer,
            groups: RefCell::new(state.trackers),
            limits,
            settled: Wakers::default(),
            acks_written: Wakers::default(),
            dead_writing: RefCell::default(),
            changing: RefCell::default(),
            changes_applied: Wakers::default(),
            folded: Rc::new(RefCell::new(state.folded)),
            snapshot_mark: Cell::new(state.snapshot_mark),
            snapshot_base: Cell::new(0),
            pending: Rc::default(),
            deferred: Rc::default(),
            started: Cell::new(0),
            retired: Cell::new(false),
            lead_check: RefCell::new(None),
            built: Built::default(),
            known_empty: Rc::default(),
            at_shard_bound: Cell::new(false),
            quiet: Cell::new(false),
            quiet_ended: Wakers::default(),
        }
    }

    /// Every group's state, for handing the shard to another core. Call it only once
    /// nothing runs on the shard: the state of a request still running would be lost.
    pub fn state(&self) -> GroupState {
        GroupState {
            trackers: self.groups.borrow().clone(),
            folded: self.folded.borrow().clone(),
            snapshot_mark: self.snapshot_mark.get(),
        }
    }

    /// How the build went (a hand-over's: nothing read).
    pub fn built(&self) -> Built {
        self.built
    }

    /// Sets what a waiting poll looks at before each pass (see [`LeadCheck`]).
    pub fn set_lead_check(&self, check: LeadCheck) {
        *self.lead_check.borrow_mut() = Some(check);
    }

    /// `Err` once these groups were dropped or this core no longer leads the shard.
    fn may_claim(&self) -> Result<(), BrokerError> {
        if self.retired.get() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        match &*self.lead_check.borrow() {
            Some(check) => check(),
            None => Ok(()),
        }
    }

    /// Marks these groups dropped: later writes are refused.
    pub fn retire(&self) {
        self.retired.set(true);
    }

    /// The log's size at the last snapshot (or, built from the log, at the snapshot the
    /// build started from).
    pub fn snapshot_mark(&self) -> u64 {
        self.snapshot_mark.get()
    }

    /// Whether any group exists.
    pub fn is_empty(&self) -> bool {
        self.groups.borrow().is_empty()
    }

    /// Snapshots started since the last call.
    pub fn take_snapshots(&self) -> u64 {
        self.started.replace(0)
    }

    /// Writes events of `group` and waits until they are durable.
    async fn write(&self, group: &str, events: &[Option<Event>]) -> Result<(), BrokerError> {
        if events.is_empty() {
            return Ok(());
        }
        if self.retired.get() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        let written = self.start_write(group, events).await;
        if written.is_ok()
            && self.pending.get() == 0
            && let Some(size) = self.deferred.take()
        {
            self.snapshot_now(size);
        }
        written
    }

    /// As [`GroupShard::write`], but the write runs to completion whatever becomes of
    /// its caller: for a request that may be cancelled mid-write (a poll whose
    /// connection closed while it dead-lettered). Cancelled, a write awaited in place
    /// was counted failed and ended snapshots until the groups were built again,
    /// though its event most likely reached the log.
    async fn write_to_completion(
        &self,
        group: &str,
        events: &[Option<Event>],
    ) -> Result<(), BrokerError> {
        if events.is_empty() {
            return Ok(());
        }
        if self.retired.get() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        let (answer, answered) = futures_channel::oneshot::channel();
        let written = self.start_write(group, events);
        task::spawn(async move {
            let _ = answer.send(written.await);
        })
        .detach();
        answered.await.unwrap_or(Err(BrokerError::Draining))
    }

    /// Hands `events` of `group` to the writer now; the returned future waits for them
    /// to be durable and settles the write's count in [`GroupShard::pending`] (a
    /// failed one ends snapshots, see [`Settle`]).
    fn start_write(
        &self,
        group: &str,
        events: &[Option<Event>],
    ) -> impl Future<Output = Result<(), BrokerError>> + 'static {
        let records: Vec<Bytes> = events.iter().map(|e| encode(group, *e)).collect();
        // With no await in between: the writer claims the events' offsets in the order
        // the folded state takes them.
        if let Some(folded) = self.folded.borrow_mut().as_mut() {
            for e in events {
                fold_event(folded, group, *e, self.limits);
            }
        }
        self.pending.set(self.pending.get() + 1);
        let written = (self.writer)(records);
        let mut settle = Settle {
            pending: self.pending.clone(),
            deferred: self.deferred.clone(),
            folded: self.folded.clone(),
            ok: false,
        };
        let known = self.known_empty.clone();
        async move {
            let a = written.await;
            settle.ok = a.is_ok();
            drop(settle);
            let a = a?;
            known.set(known.get().saw(a.first, a.end, false));
            Ok(())
        }
    }

    /// Writes a group snapshot when [`Limits::snapshot_every_bytes`] of log were written
    /// since the last: now, or once the group writes in flight are answered. In the
    /// background: no request waits for it; a failed one ends snapshots until the
    /// groups are built again. `size`: the bytes written to the shard's log now
    /// ([`SegmentLog::written_bytes`]: until 2026-12-07 its size, which retention keeps
    /// from growing, so a stream at its retention bound stopped taking snapshots);
    /// `base`: its first offset (what lies below is left out of the snapshot, see
    /// [`Tracker::forget_gone_below`]).
    ///
    /// [`SegmentLog::written_bytes`]: felix_storage_uring::SegmentLog::written_bytes
    pub fn snapshot_if_due(&self, size: u64, base: u64) {
        // A cut suffix shrinks the log: count from what is left.
        let mark = self.snapshot_mark.get().min(size);
        self.snapshot_mark.set(mark);
        if size - mark < self.limits.snapshot_every_bytes || self.retired.get() {
            return;
        }
        self.snapshot_base.set(base);
        if self.pending.get() > 0 {
            self.deferred.set(Some(size));
            return;
        }
        self.snapshot_now(size);
    }

    /// Writes a snapshot now, however little was written since the last: retention is
    /// about to remove the segments that hold the newest one (`CoreBroker::group_floor`).
    /// A snapshot waits for the group writes in flight (see [`GroupShard::pending`]),
    /// and under steady acks one is nearly always in flight, so requests arriving
    /// meanwhile wait (at most [`QUIET_WAIT_MAX`]) before they touch the groups.
    pub async fn snapshot_for_retention(&self, size: u64, base: u64) -> RetentionSnapshot {
        if let Some(no) = self.cannot_snapshot() {
            return no;
        }
        if self.pending.get() > 0 {
            // What a snapshot would hold, checked before anything waits for it.
            let too_large = self.folded.borrow_mut().as_mut().is_some_and(|folded| {
                folded.values_mut().for_each(|t| t.forget_gone_below(base));
                encode_snapshot(folded).is_none()
            });
            if too_large {
                return RetentionSnapshot::TooLarge;
            }
            let _quiet = Quiet::start(self);
            let drained = task::timeout(QUIET_WAIT_MAX, async {
                while self.pending.get() > 0 {
                    task::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
            if drained.is_none() {
                return RetentionSnapshot::Busy;
            }
            if let Some(no) = self.cannot_snapshot() {
                return no;
            }
        }
        // A write refused (a lapsed lease, a lost leadership) would stop snapshots.
        if self.may_claim().is_err() {
            return RetentionSnapshot::Busy;
        }
        // With no await since the writes drained.
        self.snapshot_base.set(base);
        if self.snapshot_now(size) {
            RetentionSnapshot::Written
        } else {
            RetentionSnapshot::TooLarge
        }
    }

    /// Why no snapshot can be taken now: the groups were dropped, or a failed write
    /// stopped snapshots.
    fn cannot_snapshot(&self) -> Option<RetentionSnapshot> {
        if self.retired.get() {
            Some(RetentionSnapshot::Retired)
        } else if self.folded.borrow().is_none() {
            Some(RetentionSnapshot::Stopped)
        } else {
            None
        }
    }

    /// Whether a snapshot was handed to the writer.
    fn snapshot_now(&self, size: u64) -> bool {
        if self.retired.get() {
            return false;
        }
        self.snapshot_mark.set(size);
        let base = self.snapshot_base.get();
        if let Some(folded) = self.folded.borrow_mut().as_mut() {
            folded.values_mut().for_each(|t| t.forget_gone_below(base));
        }
        let Some(record) = self.folded.borrow().as_ref().and_then(encode_snapshot) else {
            return false;
        };
        let written = (self.writer)(vec![record]);
        self.started.set(self.started.get() + 1);
        let (folded, known) = (self.folded.clone(), self.known_empty.clone());
        task::spawn(async move {
            match written.await {
                Ok(a) => known.set(known.get().saw(a.first, a.end, false)),
                Err(_) => *folded.borrow_mut() = None,
            }
        })
        .detach();
        true
    }

    fn note_batch(&self, base: u64, end: u64, records: bool) {
        let known = self.known_empty.get();
        self.known_empty.set(known.saw(base, end, records));
    }

    fn tracker<T>(&self, group: &str, f: impl FnOnce(&mut Tracker) -> T) -> Option<T> {
        self.groups.borrow_mut().get_mut(group).map(f)
    }

    /// The group, created (durably, its cursor at the shard's oldest retained record)
    /// when it does not exist.
    /// Whether `group` exists here.
    pub fn has(&self, group: &str) -> bool {
        self.groups.borrow().contains_key(group)
    }

    /// Whether the shard holds as many groups as it may, those being created counted:
    /// a creation checks before its write and adds after it, and creations of distinct
    /// names in flight together passed the cap.
    fn at_group_cap(&self) -> bool {
        let groups = self.groups.borrow();
        let creating = self
            .changing
            .borrow()
            .keys()
            .filter(|g| !groups.contains_key(*g))
            .count();
        groups.len() + creating >= GROUPS_PER_SHARD_MAX
    }

    async fn ensure(&self, group: &str, start: u64) -> Result<(), BrokerError> {
        if self.groups.borrow().contains_key(group) {
            return Ok(());
        }
        if self.at_group_cap() {
            return Err(BrokerError::LimitExceeded(format!(
                "a stream shard holds at most {GROUPS_PER_SHARD_MAX} groups"
            )));
        }
        let _changing = Changing::start(self, group);
        self.write(group, &[Some(Event::Seek(start))]).await?;
        self.groups
            .borrow_mut()
            .entry(group.to_owned())
            .or_insert_with(|| Tracker::new(start, self.limits));
        Ok(())
    }

    /// Waits until no seek, create or delete of `group` is written and not yet applied
    /// ([`GroupShard::changing`]). Call it before changing a tracker: no await may
    /// come between its end and the change's write.
    async fn after_changes(&self, group: &str) {
        // Mostly none is in flight: no hashing then.
        while {
            let changing = self.changing.borrow();
            !changing.is_empty() && changing.contains_key(group)
        } {
            self.changes_applied.changed().await;
        }
    }

    /// Serves one request against `stream`, the shard the groups read.
    pub async fn serve(
        &self,
        stream: &StreamShard,
        op: GroupOp,
    ) -> Result<GroupAnswer, BrokerError> {
        check_name(op.group())?;
        if op.writes_first() {
            while self.quiet.get() {
                self.quiet_ended.changed().await;
            }
        }
        self.after_changes(op.group()).await;
        let now_ms = mono_ms;
        match op {
            GroupOp::Poll {
                group,
                max,
                wait_ms,
                visibility_ms,
                member,
            } => {
                self.ensure(&group, stream.log.base_offset()).await?;
                let wait = Duration::from_millis(wait_ms).min(POLL_WAIT_MAX);
                // One answer: at most `max_claim` records (each pass of a claim is
                // bounded so, not their sum) and `POLL_BYTES_MAX` bytes of payload.
                let max = (max as usize).clamp(1, self.limits.max_claim.max(1));
                self.poll(stream, &group, max, wait, visibility_ms, member)
                    .await
                    .map(GroupAnswer::Records)
            }
            GroupOp::Ack(group, o) => self.ack(&group, o).await,
            GroupOp::Nack(group, o, delay_ms, attempts) => {
                self.tracker(&group, |t| t.nack(o, attempts, now_ms(), delay_ms))
                    .unwrap_or_else(|| Err(no_group(&group, attempts != 0)))
                    .map_err(refused)?;
                self.settled.wake_all();
                Ok(GroupAnswer::Done)
            }
            GroupOp::Extend(group, o, attempts, extend_ms) => self
                .tracker(&group, |t| t.extend(o, attempts, now_ms(), extend_ms))
                .unwrap_or_else(|| Err(no_group(&group, true)))
                .map(GroupAnswer::Extended)
                .map_err(refused),
            GroupOp::DeadLetter(group, o) => {
                // A dead letter of `o` being written (this one's first sending, its
                // answer lost, or a poll's at the attempt limit): its outcome first.
                // Then, as an ack retried, behind a seek or delete of its group that began
                // meanwhile: written before it applied, a dead letter of a deleted group
                // brought the group back at the next fold.
                let started = std::time::Instant::now();
                loop {
                    if !self.dead_writing.borrow().contains(&(group.clone(), o)) {
                        self.after_changes(&group).await;
                        if !self.dead_writing.borrow().contains(&(group.clone(), o)) {
                            break;
                        }
                    }
                    if started.elapsed() > ACK_RETRY_WAIT_MAX {
                        return Err(BrokerError::ShardUnavailable("not_ready".into()));
                    }
                    task::timeout(Duration::from_millis(100), self.acks_written.changed()).await;
                }
                let (was_full, e) = self
                    .tracker(&group, |t| (t.is_full(), t.dead_letter(o, now_ms())))
                    .map_or_else(|| (false, Err(no_group(&group, false))), |(f, e)| (f, e));
                let Some(e) = e.map_err(refused)? else {
                    return Ok(GroupAnswer::Done);
                };
                if was_full || self.at_shard_bound.replace(false) {
                    self.settled.wake_all();
                }
                let _writing = DeadWriting::start(self, &group, &[o]);
                if let Err(err) = self.write(&group, &[Some(e)]).await {
                    self.tracker(&group, |t| t.undo_dead(o));
                    self.settled.wake_all();
                    return Err(err);
                }
                Ok(GroupAnswer::Done)
            }
            GroupOp::DeadLetters(group) => Ok(GroupAnswer::DeadLetters(
                self.tracker(&group, |t| {
                    t.dead_letters().take(DEAD_LETTERS_LISTED_MAX).collect()
                })
                .unwrap_or_default(),
            )),
            GroupOp::Discard(group, o) => self.settle_dead_letter(&group, Event::Discard(o)).await,
            GroupOp::Redrive(group, o) => {
                let base = stream.log.base_offset();
                if o < base {
                    return Err(BrokerError::InvalidRequest(format!(
                        "group_redrive: offset {o} was removed by retention (the shard begins \
                         at {base}); discard it instead"
                    )));
                }
                let answer = self.settle_dead_letter(&group, Event::Redrive(o)).await;
                self.settled.wake_all();
                answer
            }
            GroupOp::Seek {
                group,
                start,
                if_new,
            } => {
                let exists = self.groups.borrow().contains_key(&group);
                let target = match start {
                    StartPosition::Earliest => stream.log.base_offset(),
                    StartPosition::Latest => stream.fanout_end(),
                    // Not `clamp`: it panics should retention ever pass the readers'
                    // end (a base above it).
                    StartPosition::Offset(Offset(o)) => {
                        o.min(stream.fanout_end()).max(stream.log.base_offset())
                    }
                };
                if exists && if_new {
                    let at = self.tracker(&group, |t| t.committed()).unwrap_or(target);
                    return Ok(GroupAnswer::Position(at, false));
                }
                if !exists && self.at_group_cap() {
                    return Err(BrokerError::LimitExceeded(format!(
                        "a stream shard holds at most {GROUPS_PER_SHARD_MAX} groups"
                    )));
                }
                let before = self.tracker(&group, |t| t.committed());
                let _changing = Changing::start(self, &group);
                self.write(&group, &[Some(Event::Seek(target))]).await?;
                self.groups
                    .borrow_mut()
                    .entry(group)
                    .or_insert_with(|| Tracker::new(target, self.limits))
                    .apply(Event::Seek(target));
                // Its claims and owed records are gone: room under the shard's bound.
                self.room_under_shard_bound();
                Ok(GroupAnswer::Position(target, before != Some(target)))
            }
            GroupOp::Describe(group) => {
                // Retention outranks a group: what it removed is skipped, not read (a
                // read at a cursor it passed failed every describe of an idle group).
                self.tracker(&group, |t| t.skip_below(stream.log.base_offset()));
                self.pass_markers(stream, &group).await?;
                let counts = self.tracker(&group, |t| {
                    t.skip_below(stream.log.base_offset());
                    t.counts(now_ms())
                });
                Ok(GroupAnswer::Info {
                    committed: counts.map(|c| c.committed),
                    tail: stream.fanout_end(),
                    in_flight: counts.map_or(0, |c| c.in_flight),
                    owed: counts.map_or(0, |c| c.owed),
                    dead_letters: counts.map_or(0, |c| c.dead_letters),
                })
            }
            GroupOp::Delete(group) => {
                if !self.groups.borrow().contains_key(&group) {
                    return Ok(GroupAnswer::Deleted(false));
                }
                let _changing = Changing::start(self, &group);
                self.write(&group, &[None]).await?;
                self.groups.borrow_mut().remove(&group);
                self.room_under_shard_bound();
                Ok(GroupAnswer::Deleted(true))
            }
        }
    }

    /// Claims left the shard's groups (a seek, a delete): polls waiting at the shard's
    /// bound look again now.
    fn room_under_shard_bound(&self) {
        if self.at_shard_bound.replace(false) {
            self.settled.wake_all();
        }
    }

    /// Moves an idle group's cursor over the offsets at it that hold no record for
    /// consumers (group events, generation markers), so its lag counts records only.
    async fn pass_markers(&self, stream: &StreamShard, group: &str) -> Result<(), BrokerError> {
        loop {
            let tail = stream.fanout_end();
            let Some(at) = self
                .tracker(group, |t| t.at_frontier().then(|| t.committed()))
                .flatten()
                .filter(|at| *at < tail)
            else {
                return Ok(());
            };
            let batches = match stream.log.read(at, 64 << 10).await {
                Ok(b) => b,
                // Removed by retention since: skipped, and looked at again from there.
                Err(felix_storage_uring::StorageError::Trimmed { oldest, .. }) => {
                    self.tracker(group, |t| t.skip_below(oldest));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            for b in &batches {
                let records = b.kind == BatchKind::Data || b.kind == BatchKind::Commit;
                self.note_batch(b.base_offset, b.end_offset(), records);
            }
            let mut moved = false;
            for b in batches.iter().take_while(|b| {
                matches!(
                    b.kind,
                    BatchKind::Group | BatchKind::GenerationStart | BatchKind::State
                )
            }) {
                if b.base_offset > at || b.end_offset() > tail {
                    break;
                }
                self.tracker(group, |t| {
                    if t.at_frontier() && t.committed() == b.base_offset {
                        (b.base_offset..b.end_offset()).for_each(|o| t.skip(o));
                        moved = true;
                    }
                });
            }
            if !moved {
                return Ok(());
            }
        }
    }

    /// An ack, answered once its event is durable. A repeated ack (a client's retry)
    /// finds the record settled already, perhaps by a write still in flight: it waits
    /// for that write, and writes the ack itself if that one failed. Answered at once,
    /// it told the client "acked" of a record a failed write then handed out again.
    async fn ack(&self, group: &str, o: u64) -> Result<GroupAnswer, BrokerError> {
        let started = std::time::Instant::now();
        loop {
            self.after_changes(group).await;
            if self.tracker(group, |t| t.is_dead(o).is_ok()) == Some(true) {
                // Acked late by the consumer whose claim lapsed on its last attempt:
                // taken off the dead letters, as a discard, durably. Answered done and
                // left listed, a redrive delivered it again.
                return self.settle_dead_letter(group, Event::Discard(o)).await;
            }
            let (was_full, event) = self
                .tracker(group, |t| (t.is_full(), t.ack(o)))
                .map_or_else(|| (false, Err(no_group(group, false))), |(f, e)| (f, e));
            let event = event.map_err(refused)?;
            if (was_full || self.at_shard_bound.get()) && event.is_some() {
                // Room under the in-flight cap (the group's or the shard's): polls held
                // back by it look again now.
                self.at_shard_bound.set(false);
                self.settled.wake_all();
            }
            if self.limits.unwritten_acks {
                if event.is_some() {
                    self.tracker(group, |t| t.ack_written(o, true));
                }
                return Ok(GroupAnswer::Done);
            }
            let Some(e) = event else {
                if self.tracker(group, |t| t.is_ack_writing(o)) != Some(true) {
                    return Ok(GroupAnswer::Done);
                }
                if started.elapsed() > ACK_RETRY_WAIT_MAX {
                    return Err(BrokerError::ShardUnavailable("not_ready".into()));
                }
                task::timeout(Duration::from_millis(100), self.acks_written.changed()).await;
                continue;
            };
            let writing = AckWriting::start(self, group, o);
            let written = self.write(group, &[Some(e)]).await;
            writing.end(written.is_ok());
            return written.map(|()| GroupAnswer::Done);
        }
    }

    async fn settle_dead_letter(
        &self,
        group: &str,
        event: Event,
    ) -> Result<GroupAnswer, BrokerError> {
        let (Event::Discard(o) | Event::Redrive(o)) = event else {
            return Err(BrokerError::Internal("not a dead-letter settle".into()));
        };
        // No group, no dead letters: not one of them (`invalid_request`), not a
        // claim to retry.
        self.tracker(group, |t| t.is_dead(o))
            .unwrap_or(Err(Refusal::NotDeadLetter(o)))
            .map_err(refused)?;
        // Durable before it is applied and answered: a redrive must not be lost. Applied
        // after, so the group's other requests wait for it ([`GroupShard::changing`]).
        let _changing = Changing::start(self, group);
        self.write(group, &[Some(event)]).await?;
        self.tracker(group, |t| t.apply(event));
        Ok(GroupAnswer::Done)
    }

    async fn poll(
        &self,
        stream: &StreamShard,
        group: &str,
        max: usize,
        wait: Duration,
        visibility_ms: u64,
        member: Option<Member>,
    ) -> Result<Vec<GroupRecord>, BrokerError> {
        let started = mono_ms();
        let deadline = started + wait.as_millis() as u64;
        loop {
            // Every pass, the first included: the request's own check ran before it
            // waited for the group's changes.
            self.may_claim()?;
            let now = mono_ms();
            let records = self
                .claim_once(stream, group, max, now, visibility_ms, member.as_ref())
                .await?;
            // A shard moving to another core answers now; the consumer asks again there.
            if !records.is_empty() || now >= deadline || stream.closing.get() {
                return Ok(records);
            }
            let next_due = self.tracker(group, |t| t.next_due_ms(now)).flatten();
            let nap = poll_nap(now, next_due, deadline);
            let woken = futures_lite::future::or(stream.appended.changed(), self.settled.changed());
            task::timeout(nap, woken).await;
        }
    }

    /// Claims up to `max` records now. Claimed offsets that hold no record for consumers
    /// (group events, generation markers) are passed over and the claim goes on, so a
    /// poll is not cut short by them.
    async fn claim_once(
        &self,
        stream: &StreamShard,
        group: &str,
        max: usize,
        now: u64,
        visibility_ms: u64,
        member: Option<&Member>,
    ) -> Result<Vec<GroupRecord>, BrokerError> {
        let mut out: Vec<GroupRecord> = Vec::new();
        let mut bytes = 0usize;
        // A member reclaims once per claim: after that its live claims include what
        // this claim just handed it.
        let mut member = member.cloned();
        let mut unanswered = Unanswered {
            shard: self,
            group,
            claims: Vec::new(),
        };
        // Each record of `out`: the claim pass that made it, and whether it is the
        // member's own claim handed back.
        let mut claims: Vec<(u64, bool)> = Vec::new();
        loop {
            self.after_changes(group).await;
            let base = stream.log.base_offset();
            let tail = stream.fanout_end();
            // The room for new claims left under the shard's bound (every group's).
            // Counted every pass: a redrive owes records past a group's own cap, so no
            // product of groups and caps bounds what they hold.
            let max_new = {
                let held: usize = self.groups.borrow().values().map(Tracker::held).sum();
                let room = self.limits.max_in_flight_per_shard.saturating_sub(held);
                if room == 0 {
                    self.at_shard_bound.set(true);
                }
                room
            };
            let Some(claimed) = self.tracker(group, |t| {
                t.skip_below(base);
                t.claim_within(
                    tail,
                    max - out.len(),
                    max_new,
                    now,
                    visibility_ms,
                    member.as_ref(),
                )
            }) else {
                return Err(BrokerError::NotFound(format!("group {group} was deleted")));
            };
            if let Some(m) = member.as_mut() {
                m.reclaim = false;
            }
            let fresh = &claimed.handed[claimed.reclaimed..];
            unanswered
                .claims
                .extend(fresh.iter().map(|&(o, _)| (o, claimed.serial)));
            if !claimed.dead.is_empty() {
                let events: Vec<_> = claimed.dead.iter().map(|o| Some(Event::Dead(*o))).collect();
                let _writing = DeadWriting::start(self, group, &claimed.dead);
                if let Err(e) = self.write_to_completion(group, &events).await {
                    self.tracker(group, |t| claimed.dead.iter().for_each(|o| t.undo_dead(*o)));
                    self.tracker(group, |t| {
                        fresh
                            .iter()
                            .for_each(|(o, _)| t.release(*o, claimed.serial))
                    });
                    return Err(e);
                }
            }
            let handed = claimed.handed.len();
            if handed == 0 && claimed.cut_short {
                task::yield_now().await;
                continue;
            }
            let budget = POLL_BYTES_MAX.saturating_sub(bytes);
            let (records, passed) = self
                .read_claimed(
                    stream,
                    group,
                    &claimed,
                    member.as_ref(),
                    budget,
                    out.is_empty(),
                )
                .await?;
            let full = records.len() + passed < handed;
            bytes += records.iter().map(|r| r.payload.len()).sum::<usize>();
            let reclaimed: HashSet<u64> = claimed.handed[..claimed.reclaimed]
                .iter()
                .map(|(o, _)| *o)
                .collect();
            claims.extend(
                records
                    .iter()
                    .map(|r| (claimed.serial, reclaimed.contains(&r.offset.0))),
            );
            let records_now = records.len();
            out.extend(records);
            // Stop when full (by count, or the answer's byte bound handed claims back),
            // when nothing more could be claimed, or when nothing was passed over.
            if out.len() >= max || handed == 0 || passed == 0 || full {
                // The last pass's records were checked as it read them, with no wait
                // since; an earlier pass's may have been taken meanwhile.
                if out.len() > records_now {
                    self.keep_held(group, &mut out, &claims, member.as_ref());
                }
                unanswered.answered();
                return Ok(out);
            }
        }
    }

    /// Keeps of `out` (made by claim passes, `claims` saying each record's pass and
    /// whether it was `member`'s own claim handed back) only what is still held: a seek
    /// or a delete applied while a later pass waited took the earlier passes' records,
    /// and a later pass may have claimed one again. Each offset once, the later.
    fn keep_held(
        &self,
        group: &str,
        out: &mut Vec<GroupRecord>,
        claims: &[(u64, bool)],
        member: Option<&Member>,
    ) {
        let name = member.map(|m| &*m.name);
        let held = self.tracker(group, |t| {
            out.iter()
                .zip(claims)
                .map(|(r, &(serial, own))| t.holds(r.offset.0, serial, name.filter(|_| own)))
                .collect::<Vec<bool>>()
        });
        let mut held = held.unwrap_or_default().into_iter();
        out.retain(|_| held.next().unwrap_or(false));
        // A member's reclaimed record passes by its name alone.
        let mut seen = HashSet::new();
        let mut later: Vec<bool> = out.iter().rev().map(|r| seen.insert(r.offset.0)).collect();
        later.reverse();
        let mut later = later.into_iter();
        out.retain(|_| later.next().unwrap_or(false));
    }

    /// Reads the records of the claimed offsets. An offset that holds no record for
    /// consumers (a replication marker) is finished without a delivery; claims past the
    /// answer's byte bound are handed back, their attempt not counted, except the first
    /// `reclaimed` (a member's own claims: they stay its own, for its next reclaim).
    /// `budget` is what is left of the answer's byte bound; the answer's `first` read
    /// hands out its first record whatever its size. A claim no longer held when the
    /// reads are done (a seek, a delete, another consumer's claim since) is not handed
    /// out: its record is another claim's now.
    async fn read_claimed(
        &self,
        stream: &StreamShard,
        group: &str,
        claimed: &Claimed,
        member: Option<&Member>,
        budget: usize,
        first: bool,
    ) -> Result<(Vec<GroupRecord>, usize), BrokerError> {
        let (handed, reclaimed) = (&claimed.handed, claimed.reclaimed);
        let mut found: BTreeMap<u64, (Bytes, u64, Before)> = BTreeMap::new();
        let mut wanted: Vec<u64> = handed.iter().map(|(o, _)| *o).collect();
        wanted.sort_unstable();
        let until = wanted.last().map_or(0, |o| o + 1);
        let mut covered_end = 0u64;
        let mut bytes = 0usize;
        for &o in &wanted {
            if o < covered_end || bytes >= budget {
                continue;
            }
            let batches = match stream
                .log
                .read_to(o, until, POLL_BYTES_MAX.min(1 << 20))
                .await
            {
                Ok(b) => b,
                // Retention removed it since it was claimed: passed over, as the next
                // poll's `skip_below` would, rather than fail a poll whose claims are
                // made.
                Err(felix_storage_uring::StorageError::Trimmed { oldest, .. }) => {
                    covered_end = covered_end.max(oldest.min(until));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            covered_end = batches.last().map_or(o + 1, |b| b.end_offset()).max(o + 1);
            // The offsets holding no record just passed, and where the read saw none
            // but them: what precedes that point is not in this read.
            let (mut empty, mut unseen_from, mut next) = (0u64, Some(o), o);
            for b in batches.into_iter().map(crate::state::readable) {
                if b.base_offset != next {
                    (empty, unseen_from) = (0, Some(b.base_offset));
                }
                next = b.end_offset();
                let records = b.kind == BatchKind::Data && !b.records.is_empty();
                self.note_batch(b.base_offset, next, records);
                if b.kind != BatchKind::Data {
                    empty += b.records.len() as u64;
                    continue;
                }
                for (i, r) in b.records.into_iter().enumerate() {
                    let at = b.base_offset + i as u64;
                    if wanted.binary_search(&at).is_ok() {
                        bytes += r.len();
                        let before = Before {
                            empty,
                            look_from: unseen_from,
                        };
                        found.insert(at, (r, b.timestamp_micros, before));
                    }
                    (empty, unseen_from) = (0, None);
                }
            }
        }
        let mut out = Vec::with_capacity(handed.len());
        // Per record of `out`, the member whose own claim it is (a reclaim), if any.
        let mut owners = Vec::with_capacity(handed.len());
        let mut look_back = Vec::new();
        let (mut bytes, mut passed) = (0usize, 0usize);
        self.tracker(group, |t| {
            for (i, &(o, attempts)) in handed.iter().enumerate() {
                let owner = member.filter(|_| i < reclaimed).map(|m| &*m.name);
                let held = t.holds(o, claimed.serial, owner);
                match found.remove(&o) {
                    None if held && o < covered_end => {
                        t.skip(o);
                        passed += 1;
                    }
                    Some((payload, at, before))
                        if held
                            && ((first && out.is_empty()) || bytes + payload.len() <= budget) =>
                    {
                        bytes += payload.len();
                        if let Some(from) = before.look_from {
                            look_back.push((out.len(), from));
                        }
                        owners.push(owner);
                        out.push(GroupRecord {
                            offset: Offset(o),
                            payload,
                            attempts,
                            skipped_before: before.empty,
                            publisher: None,
                            timestamp_micros: Some(at),
                        });
                    }
                    _ if i < reclaimed => {}
                    _ => t.release(o, claimed.serial),
                }
            }
        });
        let mut waited = false;
        for (i, from) in look_back {
            // Counted down to the base either way, so a record's count does not change
            // between deliveries when retention passed the stretch known here.
            let base = stream.log.base_offset().min(from);
            out[i].skipped_before += match self.known_empty.get().below(from) {
                Some(n) => n.min(from - base),
                None => {
                    waited = true;
                    empty_run_before(stream, from).await
                }
            };
        }
        if waited {
            // The look back read the log: a claim checked above may have lapsed and been
            // taken by another poll, or been forgotten by a seek or a delete, meanwhile.
            // Its record is that claim's now (handed out here too, two consumers held it
            // at once).
            let held = self.tracker(group, |t| {
                out.iter()
                    .zip(&owners)
                    .map(|(r, owner)| t.holds(r.offset.0, claimed.serial, *owner))
                    .collect::<Vec<bool>>()
            });
            let mut held = held.unwrap_or_default().into_iter();
            out.retain(|_| held.next().unwrap_or(false));
        }
        Ok((out, passed))
    }
}

/// How long a waiting poll that claimed nothing at `now` sleeps (unless woken by a
/// publish or a record owed again): until the next claim lapses or delayed record comes
/// due (`next_due`), its own `deadline`, or [`POLL_RECHECK`], whichever is first. A time
/// already past is not waited for: records owed now that the claim did not take were
/// held back by the group's in-flight cap, and only an ack, nack or dead letter frees
/// room (each wakes the poll); taking
/// it as the next time, the poll woke every millisecond for its whole wait, each time
/// scanning every claim in flight. ([`Tracker::next_due_ms`] leaves past times out
/// already; this holds whatever it is given.)
fn poll_nap(now: u64, next_due: Option<u64>, deadline: u64) -> Duration {
    let until = next_due
        .filter(|at| *at > now)
        .unwrap_or(u64::MAX)
        .min(deadline)
        .min(now + POLL_RECHECK.as_millis() as u64);
    Duration::from_millis(until.saturating_sub(now).max(1))
}

/// What a poll's read saw before a record: `empty` offsets holding no record right
/// before it, and, when the read began inside that run, the offset it began at (the run
/// may go on below it).
#[derive(Debug, Clone, Copy)]
struct Before {
    empty: u64,
    look_from: Option<u64>,
}

/// How many offsets immediately below `at` hold no record for consumers (group events,
/// generation-start markers, state copies), down to the log's base: a group record's
/// `skipped_before` (records trimmed by retention are not among them: their loss shows).
/// Reads backward a window at a time, the window growing while it finds no record, up
/// to [`LOOK_BACK_WINDOW_MAX`] offsets (a window read holds the records below the run
/// too). The count is advisory: a read that fails ends it with what it found (logged),
/// rather than failing a poll whose claims are already made.
async fn empty_run_before(stream: &StreamShard, at: u64) -> u64 {
    let (mut end, mut empty, mut window) = (at, 0u64, 16u64);
    loop {
        let from = end.saturating_sub(window).max(stream.log.base_offset());
        if from >= end {
            return empty;
        }
        let mut records_end = None;
        let walked = walk(stream, from, end, |b| {
            let b = crate::state::readable(b);
            if b.kind == BatchKind::Data && !b.records.is_empty() {
                records_end = Some(b.end_offset().min(end));
            }
            Ok(())
        })
        .await;
        match walked {
            Ok(_) => {}
            // Retention removed the rest while we read: the run ends at the base.
            Err(BrokerError::Cursor { .. }) => return empty,
            Err(e) => {
                tracing::warn!(shard = %stream.key, at, error = %e, "counting the offsets without a record below a group record: stopped");
                return empty;
            }
        }
        if let Some(records_end) = records_end {
            return empty + (end - records_end);
        }
        empty += end - from;
        end = from;
        window = (window * 4).min(LOOK_BACK_WINDOW_MAX);
    }
}

/// Reads `stream`'s log over `[from, until)`, 4 MiB at a time, handing each batch to
/// `f`; returns the bytes of records read.
async fn walk(
    stream: &StreamShard,
    from: u64,
    until: u64,
    mut f: impl FnMut(ReadBatch) -> Result<(), BrokerError>,
) -> Result<u64, BrokerError> {
    let (mut at, mut read) = (from, 0u64);
    while at < until {
        let batches = stream.log.read_to(at, until, 4 << 20).await?;
        let Some(last) = batches.last() else { break };
        at = last.end_offset();
        for b in batches {
            read += b.records.iter().map(|r| r.len() as u64).sum::<u64>();
            f(b)?;
        }
    }
    Ok(read)
}

/// What retention knows of where a stream shard's group snapshots lie
/// (`CoreBroker::group_floor`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotScan {
    /// The log was looked through up to here (committed records only: no cut of a
    /// suffix takes back what was seen).
    pub scanned_to: u64,
    /// The newest snapshot seen.
    pub newest: Option<u64>,
    /// The log's end when this core last asked its groups for a snapshot: not asked
    /// again before everything claimed then is committed and looked through.
    pub asked_at: u64,
    /// Whether a task asking for a snapshot runs.
    pub asking: bool,
    /// No snapshot is asked for before this ([`mono_ms`]): after one that could not
    /// be written, retention does not hold group requests back every round.
    pub not_before_ms: u64,
    /// Whether a refusal to snapshot was logged (once a life).
    pub warned: bool,
}

/// The offset of the newest group snapshot of `stream`'s log in `[from, until)`, looked
/// for from the newest segment back (retention keeps the segments from it on:
/// `CoreBroker::group_floor`).
pub async fn newest_snapshot(
    stream: &StreamShard,
    from: u64,
    until: u64,
) -> Result<Option<u64>, BrokerError> {
    let mut end = until;
    for segment in stream.log.segment_bases().into_iter().rev() {
        let start = segment.max(from);
        if start < end {
            let mut newest = None;
            walk(stream, start, end, |b| {
                if b.kind == BatchKind::Group {
                    for (i, r) in b.records.iter().enumerate() {
                        let at = b.base_offset + i as u64;
                        if (start..end).contains(&at) && is_snapshot(r) {
                            newest = Some(at);
                        }
                    }
                }
                Ok(())
            })
            .await?;
            if newest.is_some() {
                return Ok(newest);
            }
            end = start;
        }
        if segment <= from {
            break;
        }
    }
    Ok(None)
}

fn unreadable(stream: &StreamShard, offset: u64) -> BrokerError {
    BrokerError::Storage(format!(
        "{}: a group event it cannot read at offset {offset}",
        stream.key
    ))
}

/// Milliseconds on a clock that never steps, from the first call in this process.
pub(crate) fn mono_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// A settle of a claim in a group that does not exist: `stale_claim`, retryable, as for
/// an offset the group does not know; for an extend or a nack naming its attempt,
/// which a retry cannot make succeed, the fatal kind (as the reference has it).
fn no_group(group: &str, named: bool) -> Refusal {
    let why = format!("group {group} does not exist on this shard");
    if named {
        Refusal::ClaimGone(why)
    } else {
        Refusal::StaleClaim(why)
    }
}

fn refused(r: Refusal) -> BrokerError {
    match r {
        Refusal::StaleClaim(why) => BrokerError::StaleClaim(why),
        Refusal::ClaimGone(why) => BrokerError::ClaimGone(why),
        Refusal::NotDeadLetter(o) => {
            BrokerError::InvalidRequest(format!("offset {o} is not a dead letter of this group"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_channel::oneshot;

    #[test]
    fn a_waiter_that_gives_up_leaves_no_waker_behind() {
        // A long poll on a stream nobody writes times out again and again: each time
        // its waker must go, or the list (and every finished task its wakers hold)
        // grows until the next change.
        let w = Wakers::default();
        task::block_on(async {
            for _ in 0..200 {
                let waited = task::timeout(Duration::from_micros(50), w.changed()).await;
                assert!(waited.is_none());
            }
            assert_eq!(w.waiting(), 0, "timed-out waiters left their wakers");
            // Waiters still waiting are woken, and a slot freed by one that gave up
            // serves the next.
            let a = w.changed();
            let b = w.changed();
            let mut a = std::pin::pin!(a);
            let mut b = std::pin::pin!(b);
            assert!(futures_lite::future::poll_once(a.as_mut()).await.is_none());
            {
                let c = w.changed();
                let mut c = std::pin::pin!(c);
                assert!(futures_lite::future::poll_once(c.as_mut()).await.is_none());
                assert_eq!(w.waiting(), 2);
            }
            assert_eq!(w.waiting(), 1);
            assert!(futures_lite::future::poll_once(b.as_mut()).await.is_none());
            assert_eq!(w.waiting(), 2);
            w.wake_all();
            assert_eq!(w.waiting(), 0);
            assert!(futures_lite::future::poll_once(a.as_mut()).await.is_some());
            assert!(futures_lite::future::poll_once(b.as_mut()).await.is_some());
            // A future from before a wake, dropped after others took the emptied
            // slots, does not unregister them.
            let stale = w.changed();
            let mut stale = Box::pin(stale);
            assert!(
                futures_lite::future::poll_once(stale.as_mut())
                    .await
                    .is_none()
            );
            w.wake_all();
            let d = w.changed();
            let mut d = std::pin::pin!(d);
            assert!(futures_lite::future::poll_once(d.as_mut()).await.is_none());
            drop(stale);
            assert_eq!(w.waiting(), 1, "a stale future unregistered a live waiter");
        });
    }

    #[test]
    fn group_log_records_round_trip_and_garbage_is_refused() {
        for e in [
            Some(Event::Ack(7)),
            Some(Event::Dead(1 << 40)),
            Some(Event::Redrive(0)),
            Some(Event::Discard(3)),
            Some(Event::Seek(9)),
            None,
        ] {
            assert_eq!(
                decode(encode("orders-workers", e)),
                Some(("orders-workers".into(), e))
            );
        }
        assert_eq!(
            decode(Bytes::from_static(&[9, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
            None
        );
        assert_eq!(decode(Bytes::from_static(&[1, 5, b'a'])), None);
    }

    /// Events over three groups and 64 offsets, each kind as likely, one in eight a
    /// delete of its group (seeded).
    fn random_events(seed: u64, n: usize) -> Vec<(String, Option<Event>)> {
        let mut x = seed.max(1);
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..n)
            .map(|_| {
                let group = format!("g{}", next() % 3);
                let o = next() % 64;
                let event = match next() % 8 {
                    0 | 1 => Some(Event::Ack(o)),
                    2 => Some(Event::Dead(o)),
                    3 => Some(Event::Redrive(o)),
                    4 => Some(Event::Discard(o)),
                    5 | 6 => Some(Event::Seek(o / 4)),
                    _ => None,
                };
                (group, event)
            })
            .collect()
    }

    #[test]
    fn a_fold_from_the_newest_snapshot_builds_what_the_whole_fold_builds() {
        let limits = Limits::default();
        for seed in 1..200u64 {
            // The log as a leader writes it: events, and now and then a snapshot of the
            // state its events so far fold to.
            let mut folded = HashMap::new();
            let mut log: Vec<Result<(String, Option<Event>), Bytes>> = Vec::new();
            for (i, (group, event)) in random_events(seed, 300).into_iter().enumerate() {
                fold_event(&mut folded, &group, event, limits);
                log.push(Ok((group, event)));
                if (i as u64 * 7 + seed).is_multiple_of(23) {
                    log.push(Err(encode_snapshot(&folded).unwrap()));
                }
            }
            let mut whole = HashMap::new();
            for (group, event) in log.iter().filter_map(|r| r.as_ref().ok()) {
                fold_event(&mut whole, group, *event, limits);
            }
            assert_eq!(whole, folded, "seed {seed}");
            let newest = log.iter().rposition(Result::is_err).unwrap();
            let mut from_snapshot =
                decode_snapshot(log[newest].clone().unwrap_err(), limits).unwrap();
            for (group, event) in log[newest + 1..].iter().filter_map(|r| r.as_ref().ok()) {
                fold_event(&mut from_snapshot, group, *event, limits);
            }
            assert_eq!(from_snapshot, whole, "seed {seed}");
        }
    }

    /// A stream shard over a new log in `dir`.
    async fn stream_in(dir: &std::path::Path) -> StreamShard {
        stream_with(dir, Default::default()).await
    }

    /// Appends `n` one-record batches to `stream` and makes them visible to polls.
    async fn publish_visible(stream: &StreamShard, n: usize) {
        for _ in 0..n {
            let p = stream.log.begin_append(&[&b"r"[..]], 0, None).unwrap();
            let appended = stream.log.commit(p).await.unwrap();
            stream.advance_fanout(appended);
        }
    }

    /// A stream shard over a new log in `dir` whose segments hold 64 KiB.
    async fn stream_of_small_segments(dir: &std::path::Path) -> StreamShard {
        let config = felix_storage_uring::LogConfig {
            segment_bytes_max: 64 << 10,
            ..Default::default()
        };
        stream_with(dir, config).await
    }

    /// A 1000-byte record and a group event (folded into `whole`), `n` times: the
    /// events' bytes.
    async fn publish_and_events(
        stream: &StreamShard,
        whole: &mut HashMap<String, Tracker>,
        seed: u64,
        n: usize,
    ) -> u64 {
        let (data, mut event_bytes) = (Bytes::from(vec![b'd'; 1000]), 0);
        for (group, event) in random_events(seed, n) {
            let pending = stream
                .log
                .begin_append(std::slice::from_ref(&data), 0, None)
                .unwrap();
            stream.log.commit(pending).await.unwrap();
            fold_event(whole, &group, event, Limits::default());
            let record = encode(&group, event);
            event_bytes += record.len() as u64;
            let pending = stream.log.begin_group(&[record], 0).unwrap();
            stream.log.commit(pending).await.unwrap();
        }
        event_bytes
    }

    /// A stream shard over a new log in `dir` with `config`.
    async fn stream_with(
        dir: &std::path::Path,
        config: felix_storage_uring::LogConfig,
    ) -> StreamShard {
        let backend = felix_storage_uring::DmaBackend::open_dir(dir)
            .await
            .unwrap();
        let (log, _) = felix_storage_uring::SegmentLog::open(backend, config)
            .await
            .unwrap();
        let key = std::sync::Arc::new(felix_core_runtime::placement::ShardKey {
            kind: felix_core_runtime::placement::ShardKind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "s".into(),
            shard: 0,
        });
        StreamShard::new(key, log)
    }

    /// Retention's look for the newest snapshot in a range of the log finds the newest
    /// one inside it, across segments, and none where the range holds none.
    #[test]
    fn the_newest_snapshot_in_a_range_is_found_across_segments() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_of_small_segments(dir.path()).await;
            let mut whole = HashMap::new();
            let mut snapshots = Vec::new();
            for round in 0..4 {
                publish_and_events(&stream, &mut whole, 40 + round, 60).await;
                if round < 3 {
                    let record = encode_snapshot(&whole).unwrap();
                    let pending = stream.log.begin_group(&[record], 0).unwrap();
                    snapshots.push(stream.log.commit(pending).await.unwrap().first);
                }
            }
            assert!(stream.log.segment_bases().len() > 3);
            let end = stream.log.committed_end();
            let newest = |from, until| newest_snapshot(&stream, from, until);
            assert_eq!(newest(0, end).await.unwrap(), Some(snapshots[2]));
            assert_eq!(
                newest(0, snapshots[2]).await.unwrap(),
                Some(snapshots[1]),
                "the end is outside the range"
            );
            assert_eq!(
                newest(snapshots[0], snapshots[1]).await.unwrap(),
                Some(snapshots[0]),
                "the start is inside it"
            );
            assert_eq!(newest(snapshots[0] + 1, snapshots[1]).await.unwrap(), None);
            assert_eq!(newest(snapshots[2] + 1, end).await.unwrap(), None);
            // One of a layout this build cannot read counts too: a fold that meets it
            // passes every snapshot over, so an older one kept would serve none.
            let mut later = encode_snapshot(&whole).unwrap().to_vec();
            later[1] = SNAPSHOT_VERSION + 1;
            let pending = stream.log.begin_group(&[Bytes::from(later)], 0).unwrap();
            let at = stream.log.commit(pending).await.unwrap().first;
            let end = stream.log.committed_end();
            assert_eq!(newest(0, end).await.unwrap(), Some(at));
        });
    }

    /// A snapshot this build cannot read (a later layout, say) is passed over: the fold
    /// reads the whole log and builds what the events fold to, instead of failing every
    /// group request of the shard.
    #[test]
    fn a_snapshot_it_cannot_read_leaves_a_fold_of_the_whole_log() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            let limits = Limits::default();
            let write = |records: Vec<Bytes>| {
                let pending = stream.log.begin_group(&records, 0).unwrap();
                stream.log.commit(pending)
            };
            let build = || {
                let writer: GroupWriter =
                    Box::new(|_| Box::pin(async { Err(BrokerError::Draining) }));
                GroupShard::build(&stream, limits, writer)
            };
            // Events, a snapshot of what they fold to, more events: the fold starts at
            // the snapshot.
            let mut whole = HashMap::new();
            let events = random_events(11, 90);
            for (i, (group, event)) in events.iter().enumerate() {
                fold_event(&mut whole, group, *event, limits);
                write(vec![encode(group, *event)]).await.unwrap();
                if i == 40 {
                    write(vec![encode_snapshot(&whole).unwrap()]).await.unwrap();
                }
            }
            let g = build().await.unwrap();
            assert_eq!(g.built.from_snapshot, Some(41));
            assert_eq!(*g.groups.borrow(), built_from(&whole, &stream));
            // Then a snapshot of a layout this build does not know, and more events.
            let mut unknown = encode_snapshot(&whole).unwrap().to_vec();
            unknown[1] = SNAPSHOT_VERSION + 1;
            write(vec![Bytes::from(unknown)]).await.unwrap();
            for (group, event) in random_events(12, 30) {
                fold_event(&mut whole, &group, event, limits);
                write(vec![encode(&group, event)]).await.unwrap();
            }
            let g = build().await.unwrap();
            assert_eq!(g.built.from_snapshot, None, "no snapshot was used");
            assert_eq!(
                *g.groups.borrow(),
                built_from(&whole, &stream),
                "the whole log was folded"
            );
        });
    }

    /// A build that meets a segment retention removed after the build listed the
    /// segments folds the log again as it is now, instead of failing (every group
    /// request on the shard failed with it while the race lasted).
    #[test]
    fn a_build_that_meets_a_segment_retention_removed_folds_again() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_of_small_segments(dir.path()).await;
            publish_and_events(&stream, &mut HashMap::new(), 23, 300).await;
            let segments = stream.log.segment_bases().len();
            assert!(segments > 3);
            let writer: GroupWriter = Box::new(|_| Box::pin(async { Err(BrokerError::Draining) }));
            let mut build = std::pin::pin!(GroupShard::build(&stream, Limits::default(), writer));
            assert!(
                poll_once(&mut build).await.is_none(),
                "reading the newest segment"
            );
            let removed = stream
                .log
                .enforce_retention_with(0, Some(128 << 10), None)
                .await
                .unwrap();
            assert!(removed > 0);
            let g = build.await.expect("built from what retention left");
            assert_eq!(g.built.from_snapshot, None);
            assert!(stream.log.base_offset() > 0);
        });
    }

    /// A build reads the log once: back from the newest segment to the one holding the
    /// newest snapshot, keeping the group events it passes, and folds those without
    /// reading them again; with no snapshot it reads the whole log once. Either way it
    /// builds what folding every event builds.
    #[test]
    fn a_build_reads_each_segment_since_the_newest_snapshot_once() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_of_small_segments(dir.path()).await;
            let limits = Limits::default();
            let build = |keep_max| {
                let writer: GroupWriter =
                    Box::new(|_| Box::pin(async { Err(BrokerError::Draining) }));
                GroupShard::build_keeping(&stream, limits, writer, keep_max)
            };
            let mut whole = HashMap::new();
            // No snapshot: the whole log, read once.
            let event_bytes = publish_and_events(&stream, &mut whole, 21, 300).await;
            let log_bytes = 300 * 1000 + event_bytes;
            let g = build(FOLD_KEPT_BYTES_MAX).await.unwrap();
            assert!(stream.log.segment_bases().len() > 3);
            assert_eq!(g.built.from_snapshot, None);
            assert_eq!(g.built.read_bytes, log_bytes, "every record read once");
            assert_eq!(*g.groups.borrow(), built_from(&whole, &stream));
            // A snapshot, then several segments more: read back to the snapshot's
            // segment, nothing twice.
            let snapshot = encode_snapshot(&whole).unwrap();
            let pending = stream
                .log
                .begin_group(std::slice::from_ref(&snapshot), 0)
                .unwrap();
            let at = stream.log.commit(pending).await.unwrap().first;
            let snapshot_segment = *stream.log.segment_bases().last().unwrap();
            let event_bytes = publish_and_events(&stream, &mut whole, 22, 300).await;
            let g = build(FOLD_KEPT_BYTES_MAX).await.unwrap();
            assert_eq!(g.built.from_snapshot, Some(at));
            assert_eq!(*g.groups.borrow(), built_from(&whole, &stream));
            let after = 300 * 1000 + event_bytes;
            let mut since_segment = 0u64;
            for b in stream
                .log
                .read_to(snapshot_segment, at, u64::MAX as usize)
                .await
                .unwrap()
            {
                since_segment += b.records.iter().map(|r| r.len() as u64).sum::<u64>();
            }
            assert!(stream.log.segment_bases().last() > Some(&snapshot_segment));
            assert_eq!(
                g.built.read_bytes,
                since_segment + snapshot.len() as u64 + after,
                "the snapshot's segment and every later one, read once"
            );
            assert_eq!(
                g.snapshot_mark.get(),
                stream.log.written_bytes() - after,
                "the next snapshot is due counting from this one"
            );
            // Past the cap on what it keeps, the fold reads forward from the snapshot
            // again, and builds the same.
            for keep_max in [0, 2_000, 6_000] {
                let again = build(keep_max).await.unwrap();
                assert_eq!(again.built.from_snapshot, Some(at), "{keep_max}");
                assert_eq!(
                    *again.groups.borrow(),
                    built_from(&whole, &stream),
                    "{keep_max}"
                );
                assert_eq!(again.built.read_bytes, g.built.read_bytes + after);
                assert_eq!(again.snapshot_mark.get(), g.snapshot_mark.get());
            }
        });
    }

    /// What the groups learn of the log as they read and write it: a stretch without
    /// records grows only upward from a record, without a gap; a record restarts it.
    #[test]
    fn known_empty_offsets_grow_from_a_record_upward_without_a_gap() {
        let k = KnownEmpty::default();
        assert_eq!(k.below(0), Some(0), "nothing lies below the log's start");
        let k = k.saw(0, 3, true);
        assert_eq!(
            (k.below(3), k.below(1), k.below(0)),
            (Some(0), Some(0), None)
        );
        let k = k.saw(3, 5, false);
        assert_eq!(
            (k.below(4), k.below(5), k.below(6)),
            (Some(1), Some(2), None)
        );
        assert_eq!(k.saw(6, 8, false), k, "a batch past a gap teaches nothing");
        assert_eq!(
            k.saw(1, 2, true),
            k,
            "an older record forgets nothing newer"
        );
        assert_eq!(k.saw(4, 5, false), k, "nor does a stretch already known");
        let k = k.saw(4, 9, false);
        assert_eq!((k.below(9), k.below(10)), (Some(6), None));
        let k = k.saw(9, 10, true);
        assert_eq!((k.below(10), k.below(9)), (Some(0), None));
        // Batches of records read from inside: a claim starting in them lies above a
        // record; one starting at the first known record does not know what is below.
        let k = k.saw(10, 20, true).saw(12, 30, true);
        let at = |o| k.below(o);
        assert_eq!(
            (at(25), at(11), at(10), at(9)),
            (Some(0), Some(0), Some(0), None)
        );
        let k = k.saw(40, 50, true);
        assert_eq!(
            (k.below(45), k.below(35), k.below(40)),
            (Some(0), None, None)
        );
        let k = KnownEmpty::default().saw(5, 7, false);
        assert_eq!(k.below(7), None, "offsets 0..5 were never seen");
    }

    /// A record's `skipped_before` counts the offsets right below it that hold no record
    /// (group events, a generation marker, state copies), down to the base, the same on
    /// a redelivery (the poll's read then starts at the record and looks back) and over
    /// a run longer than any one backward window.
    #[test]
    fn group_records_count_the_offsets_without_a_record_just_before_them() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = Rc::new(stream_in(dir.path()).await);
            let commit = |pending| {
                let stream = stream.clone();
                async move {
                    let appended = stream.log.commit(pending).await.unwrap();
                    stream.advance_fanout(appended);
                    appended
                }
            };
            let publish = |payload: &'static [u8]| {
                commit(stream.log.begin_append(&[payload], 0, None).unwrap())
            };
            let s = stream.clone();
            let writer: GroupWriter = Box::new(move |records| {
                let s = s.clone();
                Box::pin(async move {
                    let appended = s.log.commit(s.log.begin_group(&records, 0)?).await?;
                    s.advance_fanout(appended);
                    Ok(appended)
                })
            });
            let groups = GroupShard::build(&stream, Limits::default(), writer)
                .await
                .unwrap();
            let poll = || {
                let op = GroupOp::Poll {
                    group: "g".into(),
                    max: 10,
                    wait_ms: 0,
                    visibility_ms: 0,
                    member: None,
                };
                let (groups, stream) = (&groups, &stream);
                async move {
                    match groups.serve(stream, op).await.unwrap() {
                        GroupAnswer::Records(r) => r
                            .iter()
                            .map(|r| (r.offset.0, r.skipped_before, r.attempts))
                            .collect::<Vec<_>>(),
                        other => panic!("{other:?}"),
                    }
                }
            };
            for p in [&b"a"[..], b"b", b"c"] {
                publish(p).await;
            }
            // The group's creation writes an event at 3.
            assert_eq!(poll().await, vec![(0, 0, 1), (1, 0, 1), (2, 0, 1)]);
            for o in 0..3 {
                let op = GroupOp::Ack("g".into(), o);
                groups.serve(&stream, op).await.unwrap();
            }
            // 4-6 acks, 7 a generation marker, 8-9 state copies, 10 a record.
            commit(stream.log.begin_generation_start(2, 0).unwrap()).await;
            commit(stream.log.begin_state(&[b"x", b"y"], 0).unwrap()).await;
            assert_eq!(publish(b"d").await.first, 10);
            assert_eq!(poll().await, vec![(10, 7, 1)]);
            // Handed back and delivered again: the read starts at the record.
            let op = GroupOp::Nack("g".into(), 10, 0, 0);
            groups.serve(&stream, op).await.unwrap();
            assert_eq!(poll().await, vec![(10, 7, 2)]);
            assert_eq!(empty_run_before(&stream, 0).await, 0);
            assert_eq!(empty_run_before(&stream, 3).await, 0);
            assert_eq!(empty_run_before(&stream, 10).await, 7);
            // A run of 6,000 group events (backward windows of at most 256 offsets),
            // then a record.
            for _ in 0..60 {
                let events = vec![encode("other", Some(Event::Ack(0))); 100];
                commit(stream.log.begin_group(&events, 0).unwrap()).await;
            }
            let end = stream.log.next_offset();
            assert_eq!(empty_run_before(&stream, end).await, end - 11);
            let last = publish(b"e").await.first;
            let op = GroupOp::Ack("g".into(), 10);
            groups.serve(&stream, op).await.unwrap();
            assert_eq!(poll().await, vec![(last, last - 11, 1)]);
        });
    }

    /// What a build of `stream` makes of the trackers `whole` folds to: each inherits
    /// the log's end.
    fn built_from(
        whole: &HashMap<String, Tracker>,
        stream: &StreamShard,
    ) -> HashMap<String, Tracker> {
        let mut built = whole.clone();
        for t in built.values_mut() {
            t.inherit_below(stream.log.committed_end());
        }
        built
    }

    /// Group shard whose writer hands each write's records to the test and waits for the
    /// test's answer.
    type Answers = Rc<RefCell<Vec<(Vec<Bytes>, oneshot::Sender<Result<Appended, BrokerError>>)>>>;

    fn shard_with_held_writes() -> (GroupShard, Answers) {
        shard_with_held_writes_and(Limits {
            snapshot_every_bytes: 100,
            ..Limits::default()
        })
    }

    /// [`shard_with_held_writes`] with `limits`.
    fn shard_with_held_writes_and(limits: Limits) -> (GroupShard, Answers) {
        let writes: Answers = Rc::default();
        let w = writes.clone();
        let writer: GroupWriter = Box::new(move |records| {
            let (tx, rx) = oneshot::channel();
            w.borrow_mut().push((records, tx));
            Box::pin(async move { rx.await.unwrap_or(Err(BrokerError::Draining)) })
        });
        let state = GroupState {
            trackers: HashMap::new(),
            folded: Some(HashMap::new()),
            snapshot_mark: 0,
        };
        (GroupShard::from_state(state, limits, writer), writes)
    }

    /// [`shard_with_held_writes`] holding group "w" with offset 0 claimed (attempt 1),
    /// in its trackers and in the log-order fold alike.
    fn shard_with_a_claim() -> (GroupShard, Answers) {
        let (g, writes) = shard_with_held_writes();
        claim_offset_0(&g, 0, 0);
        (g, writes)
    }

    /// Group "w" of `g` with offset 0 claimed on attempt 1, due in 200 ms, in its
    /// trackers and in the log-order fold alike.
    fn claim_due_in_200_ms(g: &GroupShard) {
        claim_offset_0(g, mono_ms(), 200);
    }

    /// A shard whose records may be tried once, its writes held, with offset 0 claimed
    /// (its one attempt) and the claim due in 200 ms.
    fn one_attempt_claimed_due_in_200_ms() -> (GroupShard, Answers) {
        let (g, writes) = shard_with_held_writes_and(Limits {
            max_attempts: 1,
            ..Limits::default()
        });
        claim_due_in_200_ms(&g);
        (g, writes)
    }

    /// A seek of group "w" to `start`.
    fn seek_w(start: StartPosition) -> GroupOp {
        GroupOp::Seek {
            group: "w".into(),
            start,
            if_new: false,
        }
    }

    /// Group "w" of `g` with offset 0 claimed at `now` on attempt 1 for `visibility_ms`,
    /// in its trackers and in the log-order fold alike.
    fn claim_offset_0(g: &GroupShard, now: u64, visibility_ms: u64) {
        let mut t = Tracker::new(0, g.limits);
        assert_eq!(
            t.claim(10, 1, now, visibility_ms, None).handed,
            vec![(0, 1)]
        );
        g.groups.borrow_mut().insert("w".into(), t.clone());
        g.folded
            .borrow_mut()
            .as_mut()
            .unwrap()
            .insert("w".into(), t);
    }

    /// A poll of "w" for up to 10 records that waits up to 5 s.
    fn long_poll() -> GroupOp {
        GroupOp::Poll {
            group: "w".into(),
            max: 10,
            wait_ms: 5_000,
            visibility_ms: 0,
            member: None,
        }
    }

    /// A poll of "w" for up to `max` records that answers at once.
    fn poll_now(max: u32) -> GroupOp {
        GroupOp::Poll {
            group: "w".into(),
            max,
            wait_ms: 0,
            visibility_ms: 0,
            member: None,
        }
    }

    /// Appends another group's event to `stream` (an offset holding no record for
    /// consumers) and makes it visible.
    async fn append_other_groups_event(stream: &StreamShard) {
        let event = encode("other", Some(Event::Ack(0)));
        let p = stream
            .log
            .begin_group(std::slice::from_ref(&event), 0)
            .unwrap();
        let appended = stream.log.commit(p).await.unwrap();
        stream.advance_fanout(appended);
    }

    /// The oldest held write, taken out: its answer's sender.
    fn first_write(writes: &Answers) -> oneshot::Sender<Result<Appended, BrokerError>> {
        writes.borrow_mut().remove(0).1
    }

    fn appended() -> Result<Appended, BrokerError> {
        appended_at(0)
    }

    /// A write answered as appended at `first`, one record.
    fn appended_at(first: u64) -> Result<Appended, BrokerError> {
        Ok(Appended {
            first,
            end: first + 1,
        })
    }

    /// One poll's answer holds at most `max_claim` records and about `POLL_BYTES_MAX`
    /// bytes, however many passes over group events its claim takes (each pass was
    /// bounded so, not their sum), and whatever `max_records` the client asked for.
    #[test]
    fn a_poll_over_records_and_group_events_is_bounded_as_a_whole() {
        felix_core_runtime::task::block_on(async {
            // Records each followed by another group's event. 6,000 of 1 KiB: more
            // than one answer's count in little bytes. 3,000 of 6 KiB: a claim pass of
            // 1,000 offsets reads 3 MB, under the byte bound, so only a bound kept
            // across passes stops the answer near 4 MiB.
            for (size, n) in [(1usize << 10, 6_000), (6 << 10, 3_000)] {
                let dir = tempfile::tempdir().unwrap();
                let stream = Rc::new(stream_in(dir.path()).await);
                let record = vec![7u8; size];
                let event = encode("other", Some(Event::Ack(0)));
                let mut pending = Vec::new();
                for _ in 0..n {
                    pending.push(stream.log.begin_append(&[&record[..]], 0, None).unwrap());
                    pending.push(
                        stream
                            .log
                            .begin_group(std::slice::from_ref(&event), 0)
                            .unwrap(),
                    );
                }
                for p in pending {
                    let appended = stream.log.commit(p).await.unwrap();
                    stream.advance_fanout(appended);
                }
                let writer: GroupWriter =
                    Box::new(|_| Box::pin(async { Ok(Appended { first: 0, end: 1 }) }));
                let limits = Limits {
                    max_claim: 1000,
                    ..Limits::default()
                };
                let groups = GroupShard::build(&stream, limits, writer).await.unwrap();
                let op = GroupOp::Poll {
                    group: "g".into(),
                    max: u32::MAX,
                    wait_ms: 0,
                    visibility_ms: 0,
                    member: None,
                };
                let GroupAnswer::Records(r) = groups.serve(&stream, op).await.unwrap() else {
                    panic!("records");
                };
                assert!(!r.is_empty());
                assert!(r.len() <= 1000, "{} records in one answer", r.len());
                let bytes: usize = r.iter().map(|r| r.payload.len()).sum();
                assert!(bytes <= POLL_BYTES_MAX, "{bytes} bytes in one answer");
            }
        });
    }

    /// A poll that read its record and then looks back over the offsets before it
    /// (counting those that hold no record) hands out only what it still holds once
    /// that read is done: its claim lapsed meanwhile and another poll took the record,
    /// which both handed out before (the claims were checked before the look back).
    #[test]
    fn a_poll_that_looks_back_hands_out_only_claims_it_still_holds() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = Rc::new(stream_in(dir.path()).await);
            // 2,000 offsets without a record for consumers, then one record.
            for _ in 0..2_000 {
                append_other_groups_event(&stream).await;
            }
            publish_visible(&stream, 1).await;
            let writer: GroupWriter =
                Box::new(|_| Box::pin(async { Ok(Appended { first: 0, end: 1 }) }));
            let limits = Limits::default();
            let g = GroupShard::build(&stream, limits, writer).await.unwrap();
            // Group "w" with its cursor at the record: a claim begins its read there,
            // so the poll then looks back for the run before it.
            let t = Tracker::new(2_000, limits);
            g.groups.borrow_mut().insert("w".into(), t.clone());
            if let Some(f) = g.folded.borrow_mut().as_mut() {
                f.insert("w".into(), t);
            }
            let poll = |visibility_ms| GroupOp::Poll {
                group: "w".into(),
                max: 10,
                wait_ms: 0,
                visibility_ms,
                member: None,
            };
            let known = g.known_empty.get();
            let a = g.serve(&stream, poll(1));
            let mut a = std::pin::pin!(a);
            // Until its read of the record is done: it is looking back now.
            let mut steps = 0;
            while g.known_empty.get() == known {
                assert!(poll_once(&mut a).await.is_none(), "it answered first");
                felix_core_runtime::task::sleep(Duration::from_micros(100)).await;
                steps += 1;
                assert!(steps < 10_000, "the poll never read its record");
            }
            // Its claim lapses, and another poll takes the record.
            felix_core_runtime::task::sleep(Duration::from_millis(5)).await;
            let GroupAnswer::Records(b) = g.serve(&stream, poll(0)).await.unwrap() else {
                panic!("records");
            };
            assert_eq!(
                b.iter()
                    .map(|r| (r.offset.0, r.attempts))
                    .collect::<Vec<_>>(),
                vec![(2_000, 2)],
                "the second poll takes the lapsed claim"
            );
            let GroupAnswer::Records(a) = a.await.unwrap() else {
                panic!("records");
            };
            assert!(
                a.iter().all(|r| r.offset.0 != 2_000),
                "both polls handed out the record: {a:?}"
            );
        });
    }

    /// A shard's groups together hold at most `max_in_flight_per_shard` claims and owed
    /// records: past it polls hand out no new record (owed ones still go out, or the
    /// groups could not drain), and room comes back as claims settle. Only each group
    /// was bounded, so one tenant's 1,024 groups could hold 10 million claims.
    #[test]
    fn a_shards_groups_together_hold_a_bounded_number_of_claims() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 20).await;
            let writer: GroupWriter =
                Box::new(|_| Box::pin(async { Ok(Appended { first: 0, end: 1 }) }));
            let limits = Limits {
                max_in_flight_per_shard: 5,
                ..Limits::default()
            };
            let g = GroupShard::build(&stream, limits, writer).await.unwrap();
            let poll = |group: &str, max| {
                let op = poll_of(group, max, 0);
                let g = &g;
                let stream = &stream;
                async move { offsets(g.serve(stream, op).await) }
            };
            let a: Vec<u64> = poll("a", 4).await;
            assert_eq!(a, vec![0, 1, 2, 3]);
            let b: Vec<u64> = poll("b", 4).await;
            assert_eq!(b, vec![0], "one claim left under the shard's bound");
            assert_eq!(poll("c", 4).await, Vec::<u64>::new());
            // An owed record goes out at the bound.
            g.serve(&stream, GroupOp::Nack("b".into(), 0, 0, 0))
                .await
                .unwrap();
            assert_eq!(poll("b", 4).await, vec![0]);
            // Settled claims give room back, and a poll waiting at the bound is woken
            // for it (not left to its next look, 100 ms on).
            let ack = GroupOp::Ack("a".into(), 0);
            assert_eq!(woken_by(&g, &stream, "c", ack, "an ack").await, vec![0]);
            g.serve(&stream, GroupOp::Ack("a".into(), 1)).await.unwrap();
            assert_eq!(poll("c", 4).await, vec![1]);
            // At the bound again (a 2, b 1, c 2): a delete gives room back and wakes too.
            let delete = GroupOp::Delete("a".into());
            assert_eq!(
                woken_by(&g, &stream, "d", delete, "the delete").await,
                vec![0, 1]
            );
        });
    }

    /// A poll of up to `max` records of `group` that waits up to `wait_ms`.
    fn poll_of(group: &str, max: u32, wait_ms: u64) -> GroupOp {
        GroupOp::Poll {
            group: group.into(),
            max,
            wait_ms,
            visibility_ms: 0,
            member: None,
        }
    }

    /// The offsets a poll's answer hands out.
    fn offsets(answer: Result<GroupAnswer, BrokerError>) -> Vec<u64> {
        match answer {
            Ok(GroupAnswer::Records(r)) => r.iter().map(|r| r.offset.0).collect(),
            other => panic!("{other:?}"),
        }
    }

    /// A poll of `group` that finds nothing to claim waits; `frees` (`what`) must wake
    /// it before it looks again by itself. What the poll then hands out.
    async fn woken_by(
        g: &GroupShard,
        stream: &StreamShard,
        group: &str,
        frees: GroupOp,
        what: &str,
    ) -> Vec<u64> {
        use futures_lite::future::poll_once;
        let waiting = g.serve(stream, poll_of(group, 4, 5_000));
        let mut waiting = std::pin::pin!(waiting);
        assert!(poll_once(&mut waiting).await.is_none(), "nothing to claim");
        assert_eq!(g.settled.waiting(), 1, "the poll waits");
        g.serve(stream, frees).await.unwrap();
        assert_eq!(g.settled.waiting(), 0, "not woken by {what}");
        loop {
            if let Some(answer) = poll_once(&mut waiting).await {
                return offsets(answer);
            }
            felix_core_runtime::task::sleep(Duration::from_millis(1)).await;
        }
    }

    /// An idle group whose cursor retention passed is described, its cursor at the
    /// log's base: it was refused `invalid_request` (a read at the removed cursor) until
    /// a poll moved it, just when an operator looks at the lag.
    #[test]
    fn a_group_whose_cursor_retention_passed_is_described() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let config = felix_storage_uring::LogConfig {
                segment_bytes_max: 64 << 10,
                ..Default::default()
            };
            let stream = stream_with(dir.path(), config).await;
            let writer: GroupWriter =
                Box::new(|_| Box::pin(async { Ok(Appended { first: 0, end: 1 }) }));
            let groups = GroupShard::build(&stream, Limits::default(), writer)
                .await
                .unwrap();
            let seek = GroupOp::Seek {
                group: "g".into(),
                start: StartPosition::Earliest,
                if_new: false,
            };
            groups.serve(&stream, seek).await.unwrap();
            let record = vec![7u8; 4 << 10];
            for _ in 0..64 {
                let p = stream.log.begin_append(&[&record[..]], 0, None).unwrap();
                let appended = stream.log.commit(p).await.unwrap();
                stream.advance_fanout(appended);
            }
            stream
                .log
                .enforce_retention_with(u64::MAX, Some(1), None)
                .await
                .unwrap();
            let base = stream.log.base_offset();
            assert!(base > 0, "retention removed segments");
            let answer = groups
                .serve(&stream, GroupOp::Describe("g".into()))
                .await
                .expect("described");
            let GroupAnswer::Info { committed, .. } = answer else {
                panic!("{answer:?}")
            };
            assert_eq!(committed, Some(base));
        });
    }

    /// A record dead-lettered because its last claim lapsed, acked late by that claim's
    /// consumer, leaves the dead letters by a durable discard: it was answered done,
    /// nothing written, and left listed for a redrive to deliver again.
    #[test]
    fn a_late_ack_of_a_dead_letter_takes_it_off_the_list() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let (g, writes) = shard_with_held_writes();
            let mut t = Tracker::new(0, g.limits);
            t.claim(10, 1, 0, 0, None);
            t.dead_letter(0, 0).unwrap();
            g.groups.borrow_mut().insert("w".into(), t.clone());
            g.folded
                .borrow_mut()
                .as_mut()
                .unwrap()
                .insert("w".into(), t);
            let mut ack = std::pin::pin!(g.ack("w", 0));
            assert!(poll_once(&mut ack).await.is_none(), "answered once written");
            let (records, answer) = writes.borrow_mut().remove(0);
            assert_eq!(records, vec![encode("w", Some(Event::Discard(0)))]);
            answer.send(appended()).unwrap();
            assert!(matches!(ack.await, Ok(GroupAnswer::Done)));
            assert_eq!(
                g.tracker("w", |t| t.dead_letters().count()),
                Some(0),
                "no longer a dead letter"
            );
        });
    }

    /// Groups being created count against the cap: two creations of distinct names in
    /// flight with one place left both passed the check made before their writes.
    #[test]
    fn groups_being_created_count_against_the_cap() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let (g, writes) = shard_with_held_writes();
            for i in 0..GROUPS_PER_SHARD_MAX - 1 {
                g.groups
                    .borrow_mut()
                    .insert(format!("g{i}"), Tracker::new(0, g.limits));
            }
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            let seek = |group: &str| GroupOp::Seek {
                group: group.into(),
                start: StartPosition::Earliest,
                if_new: false,
            };
            let mut first = std::pin::pin!(g.serve(&stream, seek("a")));
            assert!(poll_once(&mut first).await.is_none(), "its write is held");
            let mut second = std::pin::pin!(g.serve(&stream, seek("b")));
            assert!(
                matches!(
                    poll_once(&mut second).await,
                    Some(Err(BrokerError::LimitExceeded(_)))
                ),
                "a second creation passed the cap"
            );
            assert_eq!(writes.borrow().len(), 1);
            first_write(&writes).send(appended()).unwrap();
            assert!(first.await.is_ok());
            assert_eq!(g.groups.borrow().len(), GROUPS_PER_SHARD_MAX);
        });
    }

    #[test]
    fn a_repeated_ack_is_answered_only_once_the_first_acks_write_is() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            for first_fails in [false, true] {
                let (g, writes) = shard_with_a_claim();
                let mut first = std::pin::pin!(g.ack("w", 0));
                assert!(poll_once(&mut first).await.is_none());
                assert_eq!(writes.borrow().len(), 1, "the first ack's write");
                // The client's retry: the record is settled, its write not answered.
                let mut again = std::pin::pin!(g.ack("w", 0));
                assert!(
                    poll_once(&mut again).await.is_none(),
                    "a repeated ack answered before the first ack's write"
                );
                let answer = first_write(&writes);
                if first_fails {
                    answer
                        .send(Err(BrokerError::Unacknowledged("lost".into())))
                        .unwrap();
                    assert!(first.await.is_err());
                    // The retry writes the ack itself.
                    while writes.borrow().is_empty() {
                        assert!(poll_once(&mut again).await.is_none());
                        felix_core_runtime::task::yield_now().await;
                    }
                    let answer = first_write(&writes);
                    answer.send(appended()).unwrap();
                } else {
                    answer.send(appended()).unwrap();
                    assert!(matches!(first.await, Ok(GroupAnswer::Done)));
                }
                assert!(matches!(again.await, Ok(GroupAnswer::Done)));
                assert!(writes.borrow().is_empty());
                assert_eq!(g.tracker("w", |t| t.committed()), Some(1));
            }
            // A first ack whose request went away mid-write: its write's fate is
            // unknown, so the record is owed again and the retry writes the ack itself.
            let (g, writes) = shard_with_a_claim();
            {
                let mut first = std::pin::pin!(g.ack("w", 0));
                assert!(poll_once(&mut first).await.is_none());
            }
            let mut again = std::pin::pin!(g.ack("w", 0));
            assert!(poll_once(&mut again).await.is_none());
            assert_eq!(writes.borrow().len(), 2, "the retry writes its own ack");
            let (_, answer) = writes.borrow_mut().remove(1);
            answer.send(appended()).unwrap();
            assert!(matches!(again.await, Ok(GroupAnswer::Done)));
        });
    }

    /// The snapshot retention asks for waits for the group writes in flight as any
    /// does, and requests arriving meanwhile that write wait for it (under steady acks a write is
    /// nearly always in flight, and a snapshot waiting for none never came); it gives
    /// up after a while, letting them go on, and reports a failed write's stop.
    #[test]
    fn a_snapshot_for_retention_holds_new_requests_until_the_writes_in_flight_end() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            let (g, writes) = shard_with_held_writes();
            let mut ack = std::pin::pin!(g.write("w", &[Some(Event::Ack(3))]));
            assert!(poll_once(&mut ack).await.is_none());
            let mut snapshot = std::pin::pin!(g.snapshot_for_retention(1_000, 0));
            assert!(poll_once(&mut snapshot).await.is_none());
            let mut later = std::pin::pin!(g.serve(&stream, GroupOp::Ack("w".into(), 7)));
            assert!(
                poll_once(&mut later).await.is_none(),
                "a request arriving meanwhile that writes waits"
            );
            let describe = poll_once(g.serve(&stream, GroupOp::Describe("w".into()))).await;
            assert!(describe.is_some(), "one that does not write goes on");
            assert_eq!(
                writes.borrow().len(),
                1,
                "no snapshot while a write is pending"
            );
            first_write(&writes).send(appended()).unwrap();
            ack.await.unwrap();
            assert_eq!(snapshot.await, RetentionSnapshot::Written);
            assert_eq!(writes.borrow().len(), 1, "the snapshot, once");
            let record = writes.borrow_mut().remove(0).0;
            let state = decode_snapshot(record[0].clone(), g.limits).unwrap();
            assert_eq!(state["w"].durable().settled_ahead, vec![(3, 4)]);
            // Answered after it (refused: the group has no tracker here).
            let _ = later.await;
            assert_eq!(writes.borrow().len(), 0, "nothing written for it");

            // A write that never ends: it gives up, and requests go on.
            let (g, writes) = shard_with_held_writes();
            let mut ack = std::pin::pin!(g.write("w", &[Some(Event::Ack(3))]));
            assert!(poll_once(&mut ack).await.is_none());
            assert_eq!(
                g.snapshot_for_retention(1_000, 0).await,
                RetentionSnapshot::Busy
            );
            assert!(!g.quiet.get());
            assert_eq!(writes.borrow().len(), 1);

            // After a failed write: stopped, for the core to build the groups again.
            first_write(&writes)
                .send(Err(BrokerError::Unacknowledged("lost".into())))
                .unwrap();
            assert!(ack.await.is_err());
            assert_eq!(
                g.snapshot_for_retention(1_000, 0).await,
                RetentionSnapshot::Stopped
            );
        });
    }

    #[test]
    fn a_snapshot_waits_for_the_group_writes_in_flight_and_none_follows_a_failed_one() {
        felix_core_runtime::task::block_on(async {
            // Due while a write awaits its answer: deferred; taken once it succeeds.
            let (g, writes) = shard_with_held_writes();
            let mut ack = std::pin::pin!(g.write("w", &[Some(Event::Ack(3))]));
            assert!(futures_lite::future::poll_once(&mut ack).await.is_none());
            g.snapshot_if_due(1_000, 0);
            assert_eq!(
                writes.borrow().len(),
                1,
                "no snapshot while a write is pending"
            );
            first_write(&writes).send(appended()).unwrap();
            ack.await.unwrap();
            let snapshot = writes.borrow_mut().remove(0).0;
            let state = decode_snapshot(snapshot[0].clone(), g.limits).unwrap();
            assert_eq!(
                state["w"].durable().settled_ahead,
                vec![(3, 4)],
                "it holds the ack"
            );
            assert_eq!(g.take_snapshots(), 1);

            // The pending write fails: the deferred snapshot is dropped, and no later
            // one is written (the copy may hold the failed event).
            let (g, writes) = shard_with_held_writes();
            let mut ack = std::pin::pin!(g.write("w", &[Some(Event::Ack(3))]));
            assert!(futures_lite::future::poll_once(&mut ack).await.is_none());
            g.snapshot_if_due(1_000, 0);
            let answer = first_write(&writes);
            answer
                .send(Err(BrokerError::Unacknowledged("lost".into())))
                .unwrap();
            assert!(ack.await.is_err());
            g.snapshot_if_due(5_000, 0);
            assert!(
                writes.borrow().is_empty(),
                "no snapshot after a failed write"
            );

            // A request dropped before its answer counts as failed.
            let (g, writes) = shard_with_held_writes();
            {
                let mut ack = std::pin::pin!(g.write("w", &[Some(Event::Ack(3))]));
                assert!(futures_lite::future::poll_once(&mut ack).await.is_none());
            }
            writes.borrow_mut().clear();
            g.snapshot_if_due(1_000, 0);
            assert!(
                writes.borrow().is_empty(),
                "no snapshot after an unseen outcome"
            );

            // Retired groups write nothing.
            let (g, writes) = shard_with_held_writes();
            g.retire();
            assert!(g.write("w", &[Some(Event::Ack(1))]).await.is_err());
            g.snapshot_if_due(1_000, 0);
            assert!(writes.borrow().is_empty());
        });
    }

    /// A snapshot leaves out the dead letters below the log's first offset: their
    /// records are gone, and kept they grew every snapshot past its bound.
    #[test]
    fn a_snapshot_leaves_out_dead_letters_retention_removed() {
        felix_core_runtime::task::block_on(async {
            let (g, writes) = shard_with_held_writes();
            let dead: Vec<_> = [1, 4, 9].map(|o| Some(Event::Dead(o))).to_vec();
            let mut written = std::pin::pin!(g.write("w", &dead));
            assert!(
                futures_lite::future::poll_once(&mut written)
                    .await
                    .is_none()
            );
            first_write(&writes).send(appended()).unwrap();
            written.await.unwrap();
            writes.borrow_mut().clear();
            g.snapshot_if_due(1_000, 5);
            let snapshot = writes.borrow_mut().remove(0).0;
            let state = decode_snapshot(snapshot[0].clone(), g.limits).unwrap();
            assert_eq!(state["w"].durable().dead, vec![9]);
        });
    }

    #[test]
    fn snapshots_round_trip_refuse_garbage_and_stay_bounded() {
        let limits = Limits::default();
        let mut groups = HashMap::new();
        for (group, event) in [
            ("a", Event::Seek(10)),
            ("a", Event::Ack(12)),
            ("a", Event::Dead(10)),
            ("a", Event::Redrive(10)),
            ("a", Event::Dead(14)),
            ("b", Event::Ack(0)),
        ] {
            fold_event(&mut groups, group, Some(event), limits);
        }
        let record = encode_snapshot(&groups).unwrap();
        assert!(is_snapshot(&record));
        assert_eq!(
            decode_snapshot(record.clone(), limits),
            Some(groups.clone())
        );
        let a = groups["a"].durable();
        assert_eq!(
            (a.committed, a.owed.as_slice()),
            (11, &[10][..]),
            "a redrive leaves the cursor"
        );
        assert_eq!(
            (a.settled_ahead, a.dead),
            (vec![(12, 13), (14, 15)], vec![14])
        );
        // A version-1 record (written before runs: each finished offset listed) reads
        // as the same state.
        let mut v1 = BytesMut::new();
        v1.put_u8(KIND_SNAPSHOT);
        v1.put_u8(1);
        v1.put_u32(2);
        for (name, committed, high_water, owed, settled, dead) in [
            (
                "a",
                11u64,
                11u64,
                &[10u64][..],
                &[12u64, 14][..],
                &[14u64][..],
            ),
            ("b", 1, 1, &[], &[], &[]),
        ] {
            v1.put_u8(1);
            v1.put_slice(name.as_bytes());
            v1.put_u64(committed);
            v1.put_u64(high_water);
            for list in [owed, settled, dead] {
                v1.put_u32(list.len() as u32);
                list.iter().for_each(|o| v1.put_u64(*o));
            }
        }
        assert_eq!(decode_snapshot(v1.freeze(), limits), Some(groups.clone()));
        // A run that ends where it starts, or before, is refused.
        let mut empty_run = record.to_vec();
        let at = empty_run
            .windows(16)
            .position(|w| w == [0, 0, 0, 0, 0, 0, 0, 12, 0, 0, 0, 0, 0, 0, 0, 13])
            .expect("the run 12..13");
        empty_run[at + 15] = 12;
        assert_eq!(decode_snapshot(empty_run.into(), limits), None);
        // Cut anywhere, or with a byte more, it is refused.
        for cut in [0, 5, 7, record.len() - 1] {
            assert_eq!(decode_snapshot(record.slice(..cut), limits), None, "{cut}");
        }
        let mut longer = record.to_vec();
        longer.push(0);
        assert_eq!(decode_snapshot(longer.into(), limits), None);
        // Past the bound (here: 40,000 dead letters) nothing is written.
        let mut big = HashMap::new();
        for o in 0..40_000 {
            fold_event(&mut big, "c", Some(Event::Dead(o * 2)), limits);
        }
        assert_eq!(encode_snapshot(&big), None);
    }

    /// Drives `a` and `b` together, answering each write the shard hands out in the
    /// order it was handed out, until both end; then checks that the trackers are what
    /// folding the log builds (the `folded` copy takes events in the log's order).
    async fn race_and_compare(
        g: &GroupShard,
        writes: &Answers,
        a: impl Future<Output = Result<GroupAnswer, BrokerError>>,
        b: impl Future<Output = Result<GroupAnswer, BrokerError>>,
    ) {
        use futures_lite::future::poll_once;
        let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
        assert!(
            poll_once(&mut a).await.is_none(),
            "the first request writes"
        );
        let (mut a_done, mut b_done) = (false, false);
        for _ in 0..1000 {
            if !b_done && poll_once(&mut b).await.is_some() {
                b_done = true;
            }
            if !a_done && poll_once(&mut a).await.is_some() {
                a_done = true;
            }
            if a_done && b_done {
                break;
            }
            let held = !writes.borrow().is_empty();
            if held {
                first_write(writes).send(appended()).unwrap();
            }
            felix_core_runtime::task::yield_now().await;
        }
        assert!(a_done && b_done, "both requests end");
        let folded = g.folded.borrow();
        let folded = folded.as_ref().expect("no write failed");
        let groups = g.groups.borrow();
        let view = |m: &HashMap<String, Tracker>| {
            let mut v: Vec<(String, u64)> =
                m.iter().map(|(k, t)| (k.clone(), t.committed())).collect();
            v.sort();
            v
        };
        assert_eq!(
            view(&groups),
            view(folded),
            "the trackers differ from what a fold of the log builds"
        );
    }

    /// Sends a settle of offset 0 of group "w" (`send`) twice, the first sending's write
    /// held, then a delete of the group, and fails the first write: the second sending
    /// writes only once the delete is applied, and then finds no group (`what` it is).
    async fn a_resend_behind_a_delete<F, Fut>(send: F, what: &str)
    where
        F: Fn(Rc<GroupShard>, Rc<StreamShard>) -> Fut,
        Fut: Future<Output = Result<GroupAnswer, BrokerError>>,
    {
        use futures_lite::future::poll_once;
        let dir = tempfile::tempdir().unwrap();
        let stream = Rc::new(stream_in(dir.path()).await);
        let (g, writes) = shard_with_a_claim();
        let g = Rc::new(g);
        let mut first = std::pin::pin!(send(g.clone(), stream.clone()));
        assert!(poll_once(&mut first).await.is_none());
        let mut again = std::pin::pin!(send(g.clone(), stream.clone()));
        assert!(poll_once(&mut again).await.is_none());
        let mut delete = std::pin::pin!(g.serve(&stream, GroupOp::Delete("w".into())));
        assert!(poll_once(&mut delete).await.is_none());
        assert_eq!(
            writes.borrow().len(),
            2,
            "the first {what}'s and the delete's"
        );
        first_write(&writes)
            .send(Err(BrokerError::Unacknowledged("lost".into())))
            .unwrap();
        assert!(first.await.is_err());
        for _ in 0..10 {
            assert!(poll_once(&mut again).await.is_none());
            felix_core_runtime::task::yield_now().await;
        }
        assert_eq!(
            writes.borrow().len(),
            1,
            "the {what} sent again wrote while the delete was being written"
        );
        first_write(&writes).send(appended()).unwrap();
        assert!(matches!(delete.await, Ok(GroupAnswer::Deleted(true))));
        assert!(again.await.is_err(), "a {what} of a deleted group");
        assert!(writes.borrow().is_empty());
        assert!(!g.has("w"));
    }

    /// An ack retried while the first ack's write is out, whose first write then fails,
    /// writes again only after a delete of its group being written meanwhile is
    /// applied: then it finds no group. Written before (as it was), it answered "acked"
    /// and its event, after the delete in the log, brought the group back at 0.
    #[test]
    fn a_retried_ack_waits_for_a_delete_of_its_group_being_written() {
        felix_core_runtime::task::block_on(a_resend_behind_a_delete(
            |g, _| async move { g.ack("w", 0).await },
            "ack",
        ));
    }

    /// A dead letter sent again while the first sending's write is out, whose first
    /// write then fails, writes only after a delete of its group being written
    /// meanwhile is applied, as a retried ack does. Written before, its event followed
    /// the delete in the log and brought the group back, with that dead letter, at the
    /// next fold.
    #[test]
    fn a_dead_letter_sent_again_waits_for_a_delete_of_its_group_being_written() {
        felix_core_runtime::task::block_on(a_resend_behind_a_delete(
            |g, stream| async move { g.serve(&stream, GroupOp::DeadLetter("w".into(), 0)).await },
            "dead letter",
        ));
    }

    /// A seek, create or delete applies once durable, an ack or a claim at once: a
    /// request of the group arriving while such a change is written waits for it, or
    /// the trackers would take the two in the opposite order to the log. Without the
    /// wait, an ack written after a delete brought the deleted group back (at 0) in
    /// the next build, and a poll's create written after a seek's put the group back at
    /// the stream's start.
    #[test]
    fn a_request_waits_for_a_seek_create_or_delete_of_its_group_being_written() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 3).await;
            // A delete, and an ack of a claimed record of the group.
            let (g, writes) = shard_with_a_claim();
            race_and_compare(
                &g,
                &writes,
                g.serve(&stream, GroupOp::Delete("w".into())),
                g.serve(&stream, GroupOp::Ack("w".into(), 0)),
            )
            .await;
            assert!(!g.groups.borrow().contains_key("w"));
            // A seek creating a group at the stream's end, and a poll of it.
            let (g, writes) = shard_with_held_writes();
            let seek = GroupOp::Seek {
                group: "n".into(),
                start: StartPosition::Latest,
                if_new: false,
            };
            let poll = GroupOp::Poll {
                group: "n".into(),
                max: 10,
                wait_ms: 0,
                visibility_ms: 0,
                member: None,
            };
            race_and_compare(&g, &writes, g.serve(&stream, seek), g.serve(&stream, poll)).await;
            assert_eq!(g.tracker("n", |t| t.committed()), Some(3));
        });
    }

    /// A poll that passed its group's check on arrival and then waited for a claim to
    /// come due claims again only after a delete of the group written meanwhile is
    /// applied (the wait at the top of the claim loop). Claiming at once, it
    /// dead-lettered the due record (its last attempt spent) in the trackers and wrote
    /// that event after the delete in the log: the next build brought the group back.
    #[test]
    fn a_waiting_poll_claims_again_only_after_a_delete_being_written_applies() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 1).await;
            let (g, writes) = one_attempt_claimed_due_in_200_ms();
            let mut poll = std::pin::pin!(g.serve(&stream, long_poll()));
            assert!(poll_once(&mut poll).await.is_none(), "nothing to claim yet");
            let mut delete = std::pin::pin!(g.serve(&stream, GroupOp::Delete("w".into())));
            assert!(poll_once(&mut delete).await.is_none());
            assert_eq!(writes.borrow().len(), 1, "the delete's write");
            // The claim comes due while the delete is being written.
            let started = std::time::Instant::now();
            while started.elapsed() < Duration::from_millis(400) {
                assert!(poll_once(&mut poll).await.is_none());
                felix_core_runtime::task::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(
                writes.borrow().len(),
                1,
                "the poll claimed (and dead-lettered) while the delete was being written"
            );
            first_write(&writes).send(appended()).unwrap();
            assert!(matches!(delete.await, Ok(GroupAnswer::Deleted(true))));
            assert!(poll.await.is_err(), "a poll of a deleted group");
            assert!(writes.borrow().is_empty());
            assert!(!g.groups.borrow().contains_key("w"));
            assert!(!g.folded.borrow().as_ref().unwrap().contains_key("w"));
        });
    }

    /// A poll dropped while its dead letter is being written (its connection closed)
    /// leaves the write to finish: once it succeeds, snapshots go on. Awaited in place,
    /// the dropped write counted as failed and ended snapshots on the shard until its
    /// groups were built again (a restart: a fold of the whole log).
    #[test]
    fn a_poll_dropped_mid_dead_letter_keeps_snapshots_going() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 1).await;
            let (g, writes) = one_attempt_claimed_due_in_200_ms();
            felix_core_runtime::task::sleep(Duration::from_millis(250)).await;
            {
                let mut poll = std::pin::pin!(g.serve(&stream, poll_now(10)));
                assert!(poll_once(&mut poll).await.is_none());
                assert_eq!(writes.borrow().len(), 1, "the dead letter's write");
            }
            // Not unwrapped: a write awaited in place was dropped with its poll, and
            // the check below is what says so.
            let _ = first_write(&writes).send(appended());
            felix_core_runtime::task::yield_now().await;
            assert!(g.folded.borrow().is_some(), "snapshots ended");
            assert_eq!(g.pending.get(), 0);
            g.snapshot_if_due(1 << 40, 0);
            assert_eq!(writes.borrow().len(), 1, "a snapshot is written");
            // Failed, the dropped write ends them.
            let (g, writes) = one_attempt_claimed_due_in_200_ms();
            felix_core_runtime::task::sleep(Duration::from_millis(250)).await;
            {
                let mut poll = std::pin::pin!(g.serve(&stream, poll_now(10)));
                assert!(poll_once(&mut poll).await.is_none());
            }
            first_write(&writes)
                .send(Err(BrokerError::Unacknowledged("lost".into())))
                .unwrap();
            felix_core_runtime::task::yield_now().await;
            assert!(g.folded.borrow().is_none());
        });
    }

    /// A poll hands out only the claims it still holds once its reads are done: a seek
    /// applied while it waited on its dead letter's write cleared its claims, and a
    /// second poll claimed the same record; both answers carried it (two consumers
    /// holding one record at once).
    #[test]
    fn a_poll_hands_out_no_record_a_seek_gave_to_another_claim_meanwhile() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 2).await;
            let (g, writes) = one_attempt_claimed_due_in_200_ms();
            felix_core_runtime::task::sleep(Duration::from_millis(250)).await;
            // The first poll dead-letters 0, claims 1 and waits on the dead letter's write.
            let mut first = std::pin::pin!(g.serve(&stream, poll_now(10)));
            assert!(poll_once(&mut first).await.is_none());
            assert_eq!(writes.borrow().len(), 1, "the dead letter's write");
            let dead = first_write(&writes);
            // A seek back to the start is written and applied meanwhile.
            let mut seek =
                std::pin::pin!(g.serve(&stream, seek_w(StartPosition::Offset(Offset(1)))));
            assert!(poll_once(&mut seek).await.is_none());
            first_write(&writes).send(appended()).unwrap();
            assert!(matches!(seek.await, Ok(GroupAnswer::Position(1, _))));
            // A second poll claims 1.
            let second = match g.serve(&stream, poll_now(1)).await {
                Ok(GroupAnswer::Records(r)) => r,
                other => panic!("{other:?}"),
            };
            assert_eq!(second.iter().map(|r| r.offset.0).collect::<Vec<_>>(), [1]);
            // The first poll goes on once its write is done: 1 is not its to hand out.
            dead.send(appended()).unwrap();
            match first.await {
                Ok(GroupAnswer::Records(r)) => assert!(
                    r.iter().all(|r| r.offset.0 != 1),
                    "handed out beside the second poll's claim: {r:?}"
                ),
                other => panic!("{other:?}"),
            }
        });
    }

    /// A poll of several passes (the first passed over another group's event) hands out
    /// the records of its earlier passes only if they are still its own: a seek applied
    /// between two passes cleared them, the next pass claimed them again, and the answer
    /// carried each twice (only the last pass's were checked).
    #[test]
    fn a_poll_hands_out_no_record_of_an_earlier_pass_a_seek_took_back() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            // 0: a record (due to be dead-lettered), 1: another group's event, 2: a record.
            publish_visible(&stream, 1).await;
            append_other_groups_event(&stream).await;
            publish_visible(&stream, 1).await;
            let (g, writes) = one_attempt_claimed_due_in_200_ms();
            felix_core_runtime::task::sleep(Duration::from_millis(250)).await;
            // Pass 1 dead-letters 0, claims 1 and 2, and waits on the dead letter's write.
            let mut first = std::pin::pin!(g.serve(&stream, poll_now(10)));
            assert!(poll_once(&mut first).await.is_none());
            let dead = first_write(&writes);
            // A seek back to 1 starts; its write is held.
            let mut seek =
                std::pin::pin!(g.serve(&stream, seek_w(StartPosition::Offset(Offset(1)))));
            assert!(poll_once(&mut seek).await.is_none());
            // Pass 1 reads 1 (passed over) and 2, then pass 2 waits for the seek.
            dead.send(appended_at(0)).unwrap();
            for _ in 0..20 {
                assert!(poll_once(&mut first).await.is_none(), "waits for the seek");
                felix_core_runtime::task::sleep(Duration::from_millis(5)).await;
            }
            first_write(&writes).send(appended_at(3)).unwrap();
            assert!(matches!(seek.await, Ok(GroupAnswer::Position(1, _))));
            let Ok(GroupAnswer::Records(r)) = first.await else {
                panic!("records");
            };
            let offsets: Vec<u64> = r.iter().map(|r| r.offset.0).collect();
            assert_eq!(offsets, [2], "each record once, as claimed after the seek");
        });
    }

    /// A member's record reclaimed in one pass and claimed again for the same member in
    /// a later pass (a seek applied between them) goes out once: the reclaimed one passed
    /// the recheck by the member's name alone, and the answer carried it twice.
    #[test]
    fn a_reclaimed_record_claimed_again_after_a_seek_goes_out_once() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 1).await;
            let (g, writes) = shard_with_held_writes();
            let member = |reclaim| {
                Some(Member {
                    name: "m".into(),
                    reclaim,
                })
            };
            let poll = |max, reclaim| GroupOp::Poll {
                group: "w".into(),
                max,
                wait_ms: 0,
                visibility_ms: 0,
                member: member(reclaim),
            };
            // The group is made (its write answered), then m holds 0.
            let mut made = std::pin::pin!(g.serve(&stream, poll(1, false)));
            loop {
                if let Some(r) = poll_once(&mut made).await {
                    let Ok(GroupAnswer::Records(r)) = r else {
                        panic!("{r:?}")
                    };
                    assert_eq!(r.len(), 1);
                    break;
                }
                if !writes.borrow().is_empty() {
                    first_write(&writes).send(appended()).unwrap();
                }
                felix_core_runtime::task::sleep(Duration::from_millis(1)).await;
            }
            // 1: another group's event, 2: a record.
            append_other_groups_event(&stream).await;
            publish_visible(&stream, 1).await;
            // Pass 1 reclaims 0, claims 1 and 2 and reads them; a seek to 0 starts.
            let mut again = std::pin::pin!(g.serve(&stream, poll(10, true)));
            assert!(poll_once(&mut again).await.is_none(), "reading");
            let mut seek =
                std::pin::pin!(g.serve(&stream, seek_w(StartPosition::Offset(Offset(0)))));
            assert!(poll_once(&mut seek).await.is_none());
            for _ in 0..20 {
                assert!(poll_once(&mut again).await.is_none(), "waits for the seek");
                felix_core_runtime::task::sleep(Duration::from_millis(5)).await;
            }
            first_write(&writes).send(appended_at(3)).unwrap();
            assert!(matches!(seek.await, Ok(GroupAnswer::Position(0, _))));
            let Ok(GroupAnswer::Records(r)) = again.await else {
                panic!("records");
            };
            let offsets: Vec<u64> = r.iter().map(|r| r.offset.0).collect();
            assert_eq!(offsets, [0, 2], "each record once");
        });
    }

    /// A dead letter sent again while the first sending's write is in flight waits for
    /// that write: answered done at once, it told the consumer "dead-lettered" of a
    /// write that then failed, and the record went out again.
    #[test]
    fn a_dead_letter_resent_waits_for_the_first_ones_write() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 1).await;
            let (g, writes) = shard_with_a_claim();
            let dead = || GroupOp::DeadLetter("w".into(), 0);
            let mut first = std::pin::pin!(g.serve(&stream, dead()));
            assert!(poll_once(&mut first).await.is_none(), "its write is held");
            let mut again = std::pin::pin!(g.serve(&stream, dead()));
            assert!(
                poll_once(&mut again).await.is_none(),
                "waits for the first one's write"
            );
            first_write(&writes)
                .send(Err(BrokerError::Storage("full".into())))
                .unwrap();
            assert!(first.await.is_err());
            // Owed again after the failure: the resend writes the dead letter itself.
            assert!(poll_once(&mut again).await.is_none());
            assert_eq!(writes.borrow().len(), 1, "the resend's own write");
            first_write(&writes).send(appended()).unwrap();
            assert!(matches!(again.await, Ok(GroupAnswer::Done)));
            assert_eq!(
                g.tracker("w", |t| t.dead_letters().collect::<Vec<_>>()),
                Some(vec![0])
            );
        });
    }

    /// A poll dropped before it answers (its connection gone while it waited on a
    /// write) hands its claims back, their attempt not counted: they lapsed only at
    /// their visibility, an attempt counted for a delivery nobody got.
    #[test]
    fn a_poll_dropped_before_it_answers_hands_its_claims_back_uncounted() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 2).await;
            let (g, writes) = one_attempt_claimed_due_in_200_ms();
            felix_core_runtime::task::sleep(Duration::from_millis(250)).await;
            {
                // Dead-letters 0, claims 1, waits on the dead letter's write: dropped.
                let mut poll = std::pin::pin!(g.serve(&stream, long_poll()));
                assert!(poll_once(&mut poll).await.is_none());
                assert_eq!(writes.borrow().len(), 1);
            }
            let next = g.tracker("w", |t| t.claim(2, 10, mono_ms(), 0, None));
            assert_eq!(
                next.map(|c| c.handed),
                Some(vec![(1, 1)]),
                "owed again at once, on its first attempt"
            );
        });
    }

    /// A dead-letter list answers with the lowest [`DEAD_LETTERS_LISTED_MAX`]: all of
    /// them passed the SDK's frame once a group held some 1.5 million.
    #[test]
    fn a_dead_letter_list_is_bounded() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            let (g, _writes) = shard_with_held_writes();
            let mut t = Tracker::new(0, g.limits);
            let n = DEAD_LETTERS_LISTED_MAX as u64 + 5;
            (0..n).for_each(|o| t.apply(Event::Dead(o)));
            g.groups.borrow_mut().insert("w".into(), t);
            match g.serve(&stream, GroupOp::DeadLetters("w".into())).await {
                Ok(GroupAnswer::DeadLetters(listed)) => {
                    assert_eq!(listed.len(), DEAD_LETTERS_LISTED_MAX);
                    assert_eq!(listed.first(), Some(&0));
                }
                other => panic!("{other:?}"),
            }
        });
    }

    /// Settles in a group that does not exist: an extend or a named nack is refused as
    /// fatal (a retry cannot make the claim the consumer's), a discard or redrive as
    /// not a dead letter; they were `stale_claim`, which the SDK retries until its
    /// deadline.
    #[test]
    fn settles_in_a_group_that_does_not_exist_are_not_for_retrying() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            let (g, _writes) = shard_with_held_writes();
            let gone = || "nope".to_owned();
            let extend = g.serve(&stream, GroupOp::Extend(gone(), 0, 1, 1_000)).await;
            assert!(
                matches!(extend, Err(BrokerError::ClaimGone(_))),
                "{extend:?}"
            );
            let nack = g.serve(&stream, GroupOp::Nack(gone(), 0, 0, 1)).await;
            assert!(matches!(nack, Err(BrokerError::ClaimGone(_))), "{nack:?}");
            let nack = g.serve(&stream, GroupOp::Nack(gone(), 0, 0, 0)).await;
            assert!(matches!(nack, Err(BrokerError::StaleClaim(_))), "{nack:?}");
            for op in [GroupOp::Discard(gone(), 0), GroupOp::Redrive(gone(), 0)] {
                let r = g.serve(&stream, op).await;
                assert!(matches!(r, Err(BrokerError::InvalidRequest(_))), "{r:?}");
            }
        });
    }

    /// A waiting poll looks again before each pass whether this core still leads the
    /// shard. It looked only when the request came: a poll that began on the leader went
    /// on claiming for its whole wait (up to 30 s) after the broker was deposed or lost
    /// its lease, handing out a lapsed claim the new leader was handing out too.
    #[test]
    fn a_waiting_poll_stops_claiming_once_this_core_no_longer_leads() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 1).await;
            let (g, _writes) = shard_with_held_writes();
            let leads = Rc::new(Cell::new(true));
            let l = leads.clone();
            g.set_lead_check(Box::new(move || {
                if l.get() {
                    Ok(())
                } else {
                    Err(BrokerError::ShardUnavailable("stale".into()))
                }
            }));
            // Offset 0 claimed, the claim due in 200 ms.
            claim_due_in_200_ms(&g);
            let mut poll = std::pin::pin!(g.serve(&stream, long_poll()));
            assert!(poll_once(&mut poll).await.is_none(), "nothing to claim yet");
            // Deposed while the poll waits; the claim then lapses.
            leads.set(false);
            let started = std::time::Instant::now();
            let answer = loop {
                if let Some(a) = poll_once(&mut poll).await {
                    break a;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(2),
                    "the poll still waits"
                );
                felix_core_runtime::task::sleep(Duration::from_millis(10)).await;
            };
            match answer {
                Err(BrokerError::ShardUnavailable(why)) => assert_eq!(why, "stale"),
                Ok(GroupAnswer::Records(r)) => {
                    panic!(
                        "a deposed core handed out {:?}",
                        r.iter().map(|r| r.offset).collect::<Vec<_>>()
                    )
                }
                other => panic!("{other:?}"),
            }
            // Once the claim lapsed, it is owed on its first attempt: nothing here took
            // it again.
            felix_core_runtime::task::sleep(Duration::from_millis(250)).await;
            let mut left = g.groups.borrow()["w"].clone();
            assert_eq!(left.claim(1, 1, mono_ms(), 0, None).handed, vec![(0, 2)]);
        });
    }

    /// An ack that frees room under the in-flight cap wakes the polls the cap held back
    /// (they looked again only at the recheck, up to 100 ms later), and a failed ack
    /// write wakes them for the record owed again.
    #[test]
    fn an_ack_freeing_room_under_the_in_flight_cap_wakes_waiting_polls() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let stream = stream_in(dir.path()).await;
            publish_visible(&stream, 2).await;
            let (g, writes) = shard_with_held_writes_and(Limits {
                max_in_flight: 1,
                snapshot_every_bytes: 100,
                ..Limits::default()
            });
            // Offset 0 claimed for a minute: the cap is full, offset 1 waits.
            claim_offset_0(&g, mono_ms(), 60_000);
            let wakes = crate::wakes::Wakes::new();
            let mut poll = std::pin::pin!(g.serve(&stream, long_poll()));
            assert!(
                poll.as_mut().poll(&mut wakes.cx()).is_pending(),
                "held back by the cap"
            );
            let mut ack = std::pin::pin!(g.serve(&stream, GroupOp::Ack("w".into(), 0)));
            assert!(
                futures_lite::future::poll_once(&mut ack).await.is_none(),
                "the ack's write is held"
            );
            assert_eq!(
                wakes.count(),
                1,
                "the ack freed room: the waiting poll is woken"
            );
            let before = g.settled.changes.get();
            let _ = first_write(&writes).send(Err(BrokerError::Draining));
            assert!(ack.await.is_err());
            assert!(
                g.settled.changes.get() > before,
                "the failed ack's record is owed again: polls are woken"
            );
        });
    }

    #[test]
    fn a_poll_held_back_by_the_in_flight_cap_does_not_wake_every_millisecond() {
        let ms = Duration::from_millis;
        // A claim lapsing in 30 ms, a deadline in 5 s: wake for the lapse.
        assert_eq!(poll_nap(1_000, Some(1_030), 6_000), ms(30));
        // Nothing due: the recheck bound, or the deadline when sooner.
        assert_eq!(poll_nap(1_000, None, 6_000), POLL_RECHECK);
        assert_eq!(poll_nap(1_000, None, 1_020), ms(20));
        // Records owed already (due in the past) that the claim did not take: the cap
        // held them back; look again at the recheck, not in a millisecond.
        assert_eq!(poll_nap(1_000, Some(900), 6_000), POLL_RECHECK);
        assert_eq!(poll_nap(1_000, Some(1_000), 6_000), POLL_RECHECK);
    }
}
