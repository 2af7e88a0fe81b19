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
//! - [`GroupShard::serve`]: one request against the stream shard and its groups.
//!
//! Claims are memory only: after a restart or a failover, unsettled records go out again
//! (at-least-once); a live re-pin between cores hands them to the new core with the
//! shard (`core/moves.rs`). See `docs/queues.md`.

pub mod tracker;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use felix_core_runtime::task;
use felix_storage_uring::{Appended, BatchKind};
use felix_wire::Offset;
use felix_wire::message::{GroupRecord, StartPosition};

use crate::error::BrokerError;
use crate::shard::StreamShard;
use tracker::{Event, Limits, Refusal, Tracker};

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
    },
    /// Finish a record.
    Ack(String, u64),
    /// Hand a record back, owed again after `delay_ms`.
    Nack(String, u64, u64),
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
            | GroupOp::Nack(g, _, _)
            | GroupOp::Extend(g, _, _, _)
            | GroupOp::DeadLetter(g, _)
            | GroupOp::DeadLetters(g)
            | GroupOp::Discard(g, _)
            | GroupOp::Redrive(g, _)
            | GroupOp::Describe(g)
            | GroupOp::Delete(g) => g,
        }
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
#[derive(Debug, Default)]
pub struct Wakers {
    waiting: RefCell<Vec<Waker>>,
    changes: Cell<u64>,
}

impl Wakers {
    /// Wakes every waiter.
    pub fn wake_all(&self) {
        self.changes.set(self.changes.get() + 1);
        if self.waiting.borrow().is_empty() {
            return;
        }
        for w in self.waiting.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// Resolves at the next [`Wakers::wake_all`].
    pub fn changed(&self) -> impl Future<Output = ()> + '_ {
        let seen = self.changes.get();
        std::future::poll_fn(move |cx| {
            if self.changes.get() != seen {
                return Poll::Ready(());
            }
            self.waiting.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
    }
}

const KIND_ACK: u8 = 1;
const KIND_DEAD: u8 = 2;
const KIND_REDRIVE: u8 = 3;
const KIND_DISCARD: u8 = 4;
const KIND_SEEK: u8 = 5;
const KIND_DELETE: u8 = 6;

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

/// The groups of one stream shard, on its owning core while it leads.
pub struct GroupShard {
    writer: GroupWriter,
    groups: RefCell<HashMap<String, Tracker>>,
    limits: Limits,
    /// Woken when records become owed (a nack, a redrive): waiting polls look again.
    settled: Wakers,
}

impl std::fmt::Debug for GroupShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupShard")
            .field("groups", &self.groups.borrow().len())
            .finish()
    }
}

impl GroupShard {
    /// Folds the `Group` batches of `stream`'s log into trackers; later events go
    /// through `writer`.
    pub async fn build(
        stream: &StreamShard,
        limits: Limits,
        writer: GroupWriter,
    ) -> Result<Self, BrokerError> {
        let mut groups: HashMap<String, Tracker> = HashMap::new();
        let mut at = stream.log.base_offset();
        let end = stream.log.committed_end();
        while at < end {
            let batches = stream.log.read(at, 4 << 20).await?;
            let Some(last) = batches.last() else { break };
            at = last.end_offset();
            for b in batches.into_iter().filter(|b| b.kind == BatchKind::Group) {
                for r in b.records {
                    let Some((group, event)) = decode(r) else {
                        return Err(BrokerError::Storage(format!(
                            "{}: a group event it cannot read at offset {}",
                            stream.key, b.base_offset
                        )));
                    };
                    match event {
                        None => {
                            groups.remove(&group);
                        }
                        Some(e) => groups
                            .entry(group)
                            .or_insert_with(|| Tracker::new(0, limits))
                            .apply(e),
                    }
                }
            }
        }
        Ok(Self::from_trackers(groups, limits, writer))
    }

    /// The groups as another core left them (a live re-pin hands them over with the
    /// shard): their cursors, dead letters, and the claims in flight, so a record claimed
    /// before the move is not handed to a second consumer after it.
    pub fn from_trackers(
        groups: HashMap<String, Tracker>,
        limits: Limits,
        writer: GroupWriter,
    ) -> Self {
        GroupShard {
            writer,
            groups: RefCell::new(groups),
            limits,
            settled: Wakers::default(),
        }
    }

    /// Every group's state, for handing the shard to another core. Call it only once
    /// nothing runs on the shard: the state of a request still running would be lost.
    pub fn trackers(&self) -> HashMap<String, Tracker> {
        self.groups.borrow().clone()
    }

    /// Writes events of `group` and waits until they are durable.
    async fn write(&self, group: &str, events: &[Option<Event>]) -> Result<(), BrokerError> {
        if events.is_empty() {
            return Ok(());
        }
        let records: Vec<Bytes> = events.iter().map(|e| encode(group, *e)).collect();
        (self.writer)(records).await?;
        Ok(())
    }

    fn tracker<T>(&self, group: &str, f: impl FnOnce(&mut Tracker) -> T) -> Option<T> {
        self.groups.borrow_mut().get_mut(group).map(f)
    }

    /// The group, created (durably, its cursor at the shard's oldest retained record)
    /// when it does not exist.
    async fn ensure(&self, group: &str, start: u64) -> Result<(), BrokerError> {
        if self.groups.borrow().contains_key(group) {
            return Ok(());
        }
        if self.groups.borrow().len() >= GROUPS_PER_SHARD_MAX {
            return Err(BrokerError::LimitExceeded(format!(
                "a stream shard holds at most {GROUPS_PER_SHARD_MAX} groups"
            )));
        }
        self.write(group, &[Some(Event::Seek(start))]).await?;
        self.groups
            .borrow_mut()
            .entry(group.to_owned())
            .or_insert_with(|| Tracker::new(start, self.limits));
        Ok(())
    }

    /// Serves one request against `stream`, the shard the groups read.
    pub async fn serve(
        &self,
        stream: &StreamShard,
        op: GroupOp,
    ) -> Result<GroupAnswer, BrokerError> {
        check_name(op.group())?;
        let now_ms = mono_ms;
        match op {
            GroupOp::Poll {
                group,
                max,
                wait_ms,
                visibility_ms,
            } => {
                self.ensure(&group, stream.log.base_offset()).await?;
                let wait = Duration::from_millis(wait_ms).min(POLL_WAIT_MAX);
                self.poll(stream, &group, max.max(1) as usize, wait, visibility_ms)
                    .await
                    .map(GroupAnswer::Records)
            }
            GroupOp::Ack(group, o) => {
                let event = self
                    .tracker(&group, |t| t.ack(o))
                    .unwrap_or_else(|| Err(no_group(&group)))
                    .map_err(refused)?;
                if let Some(e) = event
                    && let Err(err) = self.write(&group, &[Some(e)]).await
                {
                    self.tracker(&group, |t| t.undo_settle(o, 1));
                    return Err(err);
                }
                Ok(GroupAnswer::Done)
            }
            GroupOp::Nack(group, o, delay_ms) => {
                self.tracker(&group, |t| t.nack(o, now_ms(), delay_ms))
                    .unwrap_or_else(|| Err(no_group(&group)))
                    .map_err(refused)?;
                self.settled.wake_all();
                Ok(GroupAnswer::Done)
            }
            GroupOp::Extend(group, o, attempts, extend_ms) => self
                .tracker(&group, |t| t.extend(o, attempts, now_ms(), extend_ms))
                .unwrap_or_else(|| Err(no_group(&group)))
                .map(GroupAnswer::Extended)
                .map_err(refused),
            GroupOp::DeadLetter(group, o) => {
                let e = self
                    .tracker(&group, |t| t.dead_letter(o, now_ms()))
                    .unwrap_or_else(|| Err(no_group(&group)))
                    .map_err(refused)?;
                if let Err(err) = self.write(&group, &[Some(e)]).await {
                    self.tracker(&group, |t| t.undo_dead(o));
                    return Err(err);
                }
                Ok(GroupAnswer::Done)
            }
            GroupOp::DeadLetters(group) => Ok(GroupAnswer::DeadLetters(
                self.tracker(&group, |t| t.dead_letters().collect())
                    .unwrap_or_default(),
            )),
            GroupOp::Discard(group, o) => self.settle_dead_letter(&group, Event::Discard(o)).await,
            GroupOp::Redrive(group, o) => {
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
                    StartPosition::Offset(Offset(o)) => {
                        o.clamp(stream.log.base_offset(), stream.fanout_end())
                    }
                };
                if exists && if_new {
                    let at = self.tracker(&group, |t| t.committed()).unwrap_or(target);
                    return Ok(GroupAnswer::Position(at, false));
                }
                if !exists && self.groups.borrow().len() >= GROUPS_PER_SHARD_MAX {
                    return Err(BrokerError::LimitExceeded(format!(
                        "a stream shard holds at most {GROUPS_PER_SHARD_MAX} groups"
                    )));
                }
                let before = self.tracker(&group, |t| t.committed());
                self.write(&group, &[Some(Event::Seek(target))]).await?;
                self.groups
                    .borrow_mut()
                    .entry(group)
                    .or_insert_with(|| Tracker::new(target, self.limits))
                    .apply(Event::Seek(target));
                Ok(GroupAnswer::Position(target, before != Some(target)))
            }
            GroupOp::Describe(group) => {
                self.pass_markers(stream, &group).await?;
                let counts = self.tracker(&group, |t| {
                    t.skip_below(stream.log.base_offset());
                    t.counts()
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
                self.write(&group, &[None]).await?;
                self.groups.borrow_mut().remove(&group);
                Ok(GroupAnswer::Deleted(true))
            }
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
            let batches = stream.log.read(at, 64 << 10).await?;
            let mut moved = false;
            for b in batches
                .iter()
                .take_while(|b| matches!(b.kind, BatchKind::Group | BatchKind::GenerationStart))
            {
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

    async fn settle_dead_letter(
        &self,
        group: &str,
        event: Event,
    ) -> Result<GroupAnswer, BrokerError> {
        let (Event::Discard(o) | Event::Redrive(o)) = event else {
            return Err(BrokerError::Internal("not a dead-letter settle".into()));
        };
        self.tracker(group, |t| t.is_dead(o))
            .unwrap_or_else(|| Err(no_group(group)))
            .map_err(refused)?;
        // Durable before it is applied and answered: a redrive must not be lost.
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
    ) -> Result<Vec<GroupRecord>, BrokerError> {
        let started = mono_ms();
        let deadline = started + wait.as_millis() as u64;
        loop {
            let now = mono_ms();
            let records = self
                .claim_once(stream, group, max, now, visibility_ms)
                .await?;
            // A shard moving to another core answers now; the consumer asks again there.
            if !records.is_empty() || now >= deadline || stream.closing.get() {
                return Ok(records);
            }
            let next_due = self.tracker(group, |t| t.next_due_ms()).flatten();
            let until = next_due
                .unwrap_or(u64::MAX)
                .min(deadline)
                .min(now + POLL_RECHECK.as_millis() as u64);
            let nap = Duration::from_millis(until.saturating_sub(now).max(1));
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
    ) -> Result<Vec<GroupRecord>, BrokerError> {
        let mut out = Vec::new();
        loop {
            let base = stream.log.base_offset();
            let tail = stream.fanout_end();
            let Some(claimed) = self.tracker(group, |t| {
                t.skip_below(base);
                t.claim(tail, max - out.len(), now, visibility_ms)
            }) else {
                return Err(BrokerError::NotFound(format!("group {group} was deleted")));
            };
            if !claimed.dead.is_empty() {
                let events: Vec<_> = claimed.dead.iter().map(|o| Some(Event::Dead(*o))).collect();
                if let Err(e) = self.write(group, &events).await {
                    self.tracker(group, |t| claimed.dead.iter().for_each(|o| t.undo_dead(*o)));
                    self.tracker(group, |t| {
                        claimed.handed.iter().for_each(|(o, a)| t.release(*o, *a))
                    });
                    return Err(e);
                }
            }
            let handed = claimed.handed.len();
            let (records, passed) = self.read_claimed(stream, group, &claimed.handed).await?;
            let full = records.len() + passed < handed;
            out.extend(records);
            // Stop when full (by count, or the answer's byte bound handed claims back),
            // when nothing more could be claimed, or when nothing was passed over.
            if out.len() >= max || handed == 0 || passed == 0 || full {
                return Ok(out);
            }
        }
    }

    /// Reads the records of the claimed offsets. An offset that holds no record for
    /// consumers (a replication marker) is finished without a delivery; claims past the
    /// answer's byte bound are handed back, their attempt not counted.
    async fn read_claimed(
        &self,
        stream: &StreamShard,
        group: &str,
        handed: &[(u64, u32)],
    ) -> Result<(Vec<GroupRecord>, usize), BrokerError> {
        let mut found: BTreeMap<u64, (Bytes, u64)> = BTreeMap::new();
        let mut wanted: Vec<u64> = handed.iter().map(|(o, _)| *o).collect();
        wanted.sort_unstable();
        let until = wanted.last().map_or(0, |o| o + 1);
        let mut covered_end = 0u64;
        let mut bytes = 0usize;
        for &o in &wanted {
            if o < covered_end || bytes >= POLL_BYTES_MAX {
                continue;
            }
            let batches = stream
                .log
                .read_to(o, until, POLL_BYTES_MAX.min(1 << 20))
                .await?;
            covered_end = batches.last().map_or(o + 1, |b| b.end_offset()).max(o + 1);
            for b in batches.into_iter().map(crate::state::readable) {
                if b.kind != BatchKind::Data {
                    continue;
                }
                for (i, r) in b.records.into_iter().enumerate() {
                    let at = b.base_offset + i as u64;
                    if wanted.binary_search(&at).is_ok() {
                        bytes += r.len();
                        found.insert(at, (r, b.timestamp_micros));
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(handed.len());
        let (mut bytes, mut passed) = (0usize, 0usize);
        self.tracker(group, |t| {
            for &(o, attempts) in handed {
                match found.remove(&o) {
                    None if o < covered_end => {
                        t.skip(o);
                        passed += 1;
                    }
                    Some((payload, at))
                        if out.is_empty() || bytes + payload.len() <= POLL_BYTES_MAX =>
                    {
                        bytes += payload.len();
                        out.push(GroupRecord {
                            offset: Offset(o),
                            payload,
                            attempts,
                            skipped_before: 0,
                            publisher: None,
                            timestamp_micros: Some(at),
                        });
                    }
                    _ => t.release(o, attempts),
                }
            }
        });
        Ok((out, passed))
    }
}

/// Milliseconds on a clock that never steps, from the first call in this process.
fn mono_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

fn no_group(group: &str) -> Refusal {
    Refusal::StaleClaim(format!("group {group} does not exist on this shard"))
}

fn refused(r: Refusal) -> BrokerError {
    match r {
        Refusal::StaleClaim(why) => BrokerError::StaleClaim(why),
        Refusal::NotDeadLetter(o) => {
            BrokerError::InvalidRequest(format!("offset {o} is not a dead letter of this group"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
