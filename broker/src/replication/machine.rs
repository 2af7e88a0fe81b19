//! One replica of one shard: leader, candidate or follower, as a sans-IO state machine.
//!
//! Inputs are `handle_*` calls (an assignment from the control plane, a message from a
//! peer, a local log event, a timer) with `now` passed in; outputs are polled with
//! [`Replica::poll_output`]: messages to send, durable metadata to write, batches to
//! store, suffixes to cut, ranges to read for shipping, commit marks. The driver
//! (`peer.rs`) only carries them out; the simulator (`sim.rs`) runs several replicas
//! over a faulty network in virtual time. The design and why each rule exists:
//! `docs/replication.md`.
//!
//! What must stay true (the simulator checks it after every step):
//! - A replica accepts a generation only by a `Fence` from its leader, and persists the
//!   ballot `(generation, leader)` before answering; from then on it refuses older
//!   generations and other leaders at that generation. So a deposed leader cannot collect
//!   a majority once its successor has fenced one. The leader is the one the control
//!   plane's assignment names at that generation: a fence at a generation no assignment
//!   handed to this replica names its sender leader at waits for that assignment (a
//!   peer's node token proves only who it is, and a ballot taken at a made-up
//!   generation would be persisted, refusing every real leader after it).
//! - A candidate serves only after a majority (itself counted) has fenced, after taking
//!   the furthest-ahead log among them by `(generation of the last record, end)`, and
//!   after appending its generation-start record. Any majority intersects the one that
//!   held an acknowledged record, so the new leader holds every acknowledged record.
//! - The commit mark counts a majority only at offsets past the leader's own
//!   generation-start record (Raft's figure 8: a record of an older generation held by a
//!   majority may still be overwritten unless a record of the current one is committed
//!   after it).
//! - Nothing below a replica's commit mark is ever cut. Records at equal offsets with
//!   equal generations are equal (one writer per generation), which is what lets a
//!   follower compare logs by generation labels instead of bytes.
//! - Batches keep the boundaries their writer gave them on every replica, so a cut is
//!   always at a batch boundary.
//! - A replica that lost its copy (found damaged at open, set aside, started over
//!   empty) may have acknowledged records it no longer holds, so it counts toward no
//!   election until it holds everything it could have acknowledged: it answers fences
//!   with [`Refusal::Rebuilding`] (ballot persisted, records taken), a candidate of its
//!   counts a majority of the others, and it never leads a generation it held before
//!   the loss (writing under that label again would give one offset two values with
//!   one label). It is whole again once it verified a leader of a later generation's
//!   log past that leader's start record (that leader was elected without it, so holds
//!   every record committed before), or once it wins an election itself.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

/// A broker's node id.
pub type NodeId = Arc<str>;

/// How long a sent `Fence` or batch waits for its answer before it is sent again.
pub const RESEND_AFTER: Duration = Duration::from_millis(400);
/// How often an idle leader tells followers the commit mark (an empty batch).
pub const COMMIT_HEARTBEAT: Duration = Duration::from_millis(200);
/// How often an idle leader sends every follower its commit mark even when it was
/// told it already: a follower that restarted since (its mark is a stale hint) learns
/// it, and a rebuilt copy gets the message it verifies its log by.
pub const KEEPALIVE: Duration = Duration::from_secs(2);
/// Bytes a leader ships to one follower in one message.
pub const SHIP_BYTES: usize = 1 << 20;
/// Batch messages a leader keeps in flight to one follower. With one, a follower's
/// disk sat idle while an answer and the next message crossed the network and the
/// leader read its log; with several, the follower stores each contiguous message as it
/// arrives, and one fsync covers what arrived meanwhile.
pub const MAX_IN_FLIGHT: usize = 4;
/// How long a candidate of a planned handoff waits for the old leader's fence before it
/// goes on as after a failover, with any majority. The old leader, being up, answers
/// in milliseconds; the bound is for one that died meanwhile (writes held at the new
/// leader wait out 1 s before they are refused).
pub const HANDOFF_WAIT: Duration = Duration::from_millis(800);
/// `prev_generation` of a message starting at the sender's base: the record before is
/// gone there, committed, and equal everywhere.
pub const BELOW_BASE: u64 = u64::MAX;

/// What a batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchKind {
    /// Client records.
    Data,
    /// The first record of a generation (its payload is the generation).
    GenerationStart(u64),
    /// An atomic commit (one record).
    Commit,
    /// Consumer-group events.
    Group,
    /// Copies of state entries carried past retention.
    State,
}

/// A batch at its offsets, as stored and shipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Offset of the first record.
    pub base: u64,
    /// Data or generation start.
    pub kind: BatchKind,
    /// Append time.
    pub timestamp_micros: u64,
    /// An idempotent producer's `(producer_id, sequence)`, shipped with the batch so a
    /// promoted replica answers re-sends too.
    pub producer: Option<(u64, u64)>,
    /// The records.
    pub records: Vec<Bytes>,
}

impl Batch {
    /// One past the last record.
    pub fn end(&self) -> u64 {
        self.base + self.records.len() as u64
    }

    /// The record that begins `generation` at `base`: its payload is the generation,
    /// 8 bytes big-endian.
    pub fn generation_start(base: u64, generation: u64) -> Batch {
        Batch {
            base,
            kind: BatchKind::GenerationStart(generation),
            timestamp_micros: 0,
            producer: None,
            records: vec![Bytes::copy_from_slice(&generation.to_be_bytes())],
        }
    }
}

/// The generation a generation-start batch's records name (`None` when malformed).
pub fn generation_named(records: &[Bytes]) -> Option<u64> {
    let g = records.first()?.get(..8)?;
    Some(u64::from_be_bytes(g.try_into().expect("8 bytes")))
}

/// Why a replica refused a batch or a fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The batch starts past the replica's end: resume at `expected`.
    Gap,
    /// The logs disagree at or before the batch: resume at `expected`.
    Mismatch,
    /// A newer generation, or another leader at this one, was accepted.
    Fenced,
    /// This generation was never fenced here: fence first.
    NotFenced,
    /// Storing it would cut committed records: this follower is halted.
    BelowCommit,
    /// The replica's log ends below the leader's base: bootstrap it.
    Bootstrap,
    /// Busy or failing locally: try again later.
    Unavailable,
    /// Answers a fence: the ballot is accepted and records are taken, but this replica
    /// lost its copy and may not be counted toward an election (see [`Meta::rebuilding`]).
    /// It is whole again once it verified this generation's start record.
    Rebuilding,
    /// As [`Refusal::Rebuilding`], but the copy was lost at this generation or a later
    /// one, so it cannot be whole again at it: its leader reports it, and the control
    /// plane starts a new generation.
    RebuildingNeedsGeneration,
}

/// A message between replicas of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// A leader asks a replica to accept `generation` with it as leader.
    Fence {
        /// Generation.
        generation: u64,
    },
    /// The replica accepted: what its log holds.
    FenceOk {
        /// Generation accepted.
        generation: u64,
        /// Oldest offset held.
        base: u64,
        /// One past the last durable record.
        end: u64,
        /// Its commit mark.
        commit: u64,
        /// Generation of its last record (0 when empty).
        last_generation: u64,
    },
    /// A candidate reads a fenced replica's log from `from`.
    Fetch {
        /// The candidate's generation.
        generation: u64,
        /// First offset wanted.
        from: u64,
    },
    /// Batches at their offsets, starting at `from`.
    Records {
        /// The sender's generation.
        generation: u64,
        /// Where the message starts (the first batch's base, if any).
        from: u64,
        /// Generation of the record at `from - 1` in the sender's log: 0 when `from` is 0,
        /// [`BELOW_BASE`] when the sender no longer holds it (retention).
        prev_generation: u64,
        /// The sender's commit mark.
        commit: u64,
        /// Contiguous batches (may be empty: a commit heartbeat).
        batches: Vec<Batch>,
        /// Whether this answers a `Fetch` (a candidate catching up) rather than shipping.
        fetched: bool,
    },
    /// The replica durably holds the shipped range up to `end`.
    Ok {
        /// Generation.
        generation: u64,
        /// One past the last record verified and durable.
        end: u64,
    },
    /// A refusal.
    Refused {
        /// The refusing replica's accepted generation.
        generation: u64,
        /// Why.
        code: Refusal,
        /// Where to resume (Gap, Mismatch) or the base to bootstrap at.
        expected: u64,
    },
    /// The leader's log begins at `base`: start an empty log there.
    Bootstrap {
        /// Generation.
        generation: u64,
        /// The leader's base.
        base: u64,
    },
}

/// What the control plane assigned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Generation (+1 on every assignment write).
    pub generation: u64,
    /// The leader.
    pub leader: NodeId,
    /// Every replica, leader included: the members majorities are counted over.
    pub replicas: Vec<NodeId>,
    /// Copies being staged for a move (not in `replicas`): shipped to like followers,
    /// never counted toward a majority (fence or commit), never leaders.
    pub learners: Vec<NodeId>,
    /// The leader this generation takes over from in a planned handoff (a move or a
    /// drain, not a failover): it is up, and its log holds every record it
    /// acknowledged, `Leader`-mode ones no follower holds yet among them. The new
    /// leader waits up to [`HANDOFF_WAIT`] for its fence before it picks the log to
    /// take; a majority without it could lack that tail.
    pub handoff_from: Option<NodeId>,
}

/// The durable part of a replica's state, written before it is relied on.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    /// Highest generation accepted.
    pub generation: u64,
    /// The leader accepted at it.
    pub leader: Option<String>,
    /// Commit mark known (a hint: a lower value is always safe).
    pub commit: u64,
    /// The copy was lost (found damaged and set aside) while this was the highest
    /// generation accepted: the log started over empty, and until it is whole again it
    /// counts toward no election and leads no generation up to this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuilding: Option<u64>,
    /// A life of this copy ran under `fsync: none` or `periodic` and crashed while this
    /// was the highest generation accepted: its log may lack records it acknowledged, a
    /// leader's counted durable at sequencing among them, so it leads no generation up
    /// to this one (led again under the same label, it would write other records at
    /// offsets its followers hold acknowledged ones at, and followers compare logs by
    /// label). Named leader of one, it reports that it cannot lead, and the control
    /// plane promotes another member at a newer generation, which takes the furthest
    /// log. Not when it is the set's only member (no copy holds anything it lacks).
    /// Kept durably: the log's mark that tells of such a crash is gone after the next
    /// clean close.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_lead_through: Option<u64>,
}

/// What the machine asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send `msg` to `to`.
    Send {
        /// Peer.
        to: NodeId,
        /// Message.
        msg: Msg,
    },
    /// Write `meta` durably, then call [`Replica::handle_persisted`].
    Persist(Meta),
    /// Keep these generation starts `(offset, generation)` with the log, durably: its
    /// base moved past the records that began them, and a restart must still know the
    /// generation of the records at the base (see [`Replica::epochs_through`]).
    KeepEpochs(Vec<(u64, u64)>),
    /// Store these batches at their offsets (they start at the log's end), then report
    /// durability with [`Replica::handle_durable`].
    Store(Vec<Batch>),
    /// Cut every record at or after `from` durably, then call
    /// [`Replica::handle_truncated`].
    Truncate {
        /// First offset removed.
        from: u64,
    },
    /// Drop every record and start over with an empty log at `base`, then call
    /// [`Replica::handle_truncated`].
    ResetAt {
        /// New base.
        base: u64,
    },
    /// Read durable batches from `from` (up to [`SHIP_BYTES`]) and hand them to
    /// [`Replica::handle_read`] for `to`; `fetch` when answering a candidate's fetch.
    Read {
        /// Who they are for.
        to: NodeId,
        /// First offset.
        from: u64,
        /// Answering a fetch (not shipping).
        fetch: bool,
    },
    /// Append this generation's start record at the log's end (as a leader's own
    /// append), then report durability with [`Replica::handle_durable`].
    AppendGenerationStart {
        /// Generation.
        generation: u64,
    },
    /// The commit mark moved: acknowledgements and readers may go up to here.
    Commit(u64),
    /// Whether this replica may take writes as leader now.
    Serving(bool),
    /// A follower was halted (its log cannot be repaired without losing committed
    /// records); reported for operators.
    Halted {
        /// The follower.
        peer: NodeId,
    },
    /// A member showed this replica a newer generation than every assignment it was
    /// handed (it stopped leading): read the control plane's assignments now, not when
    /// the feed next brings them, so the newer leader's fence is answered soon.
    AssignmentWanted,
}

/// The local log as the machine sees it.
#[derive(Debug, Clone, Default)]
struct LogView {
    base: u64,
    /// One past the last record claimed (written or being written).
    end: u64,
    /// One past the last durable record.
    durable: u64,
    /// Where each generation begins: start offset -> generation.
    epochs: BTreeMap<u64, u64>,
    /// `(generation, end)`: below `end` this log was verified equal to the log of that
    /// generation's leader (and answered `Ok`). A cut lowers it.
    verified: (u64, u64),
}

impl LogView {
    fn generation_at(&self, offset: u64) -> u64 {
        self.epochs
            .range(..=offset)
            .next_back()
            .map_or(0, |(_, g)| *g)
    }

    /// The generation of the last durable record, held or removed: a log whose every
    /// record went below its base (retention, a compaction's cut) still ends with them,
    /// and the epochs kept for the base say their generation. (Answering 0 for such a
    /// log lost an election for a replica holding acknowledged records: found by the
    /// simulator once followers took the commit mark promptly.)
    fn last_generation(&self) -> u64 {
        if self.durable == 0 {
            0
        } else {
            self.generation_at(self.durable - 1)
        }
    }

    /// Where the epoch holding `offset` begins.
    fn epoch_start(&self, offset: u64) -> u64 {
        self.epochs
            .range(..=offset)
            .next_back()
            .map_or(self.base, |(o, _)| *o)
    }

    fn observe(&mut self, batches: &[Batch]) {
        for b in batches {
            if let BatchKind::GenerationStart(g) = b.kind {
                self.epochs.insert(b.base, g);
            }
            self.end = self.end.max(b.end());
        }
    }

    fn cut(&mut self, from: u64) {
        self.verified.1 = self.verified.1.min(from);
        self.epochs.split_off(&from);
        self.end = from;
        self.durable = self.durable.min(from);
    }
}

/// A follower as its leader reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Follower {
    /// The follower.
    pub peer: NodeId,
    /// One past the last record it durably holds, verified at this generation.
    pub matched: u64,
    /// Refused to cut committed records: not shipped to.
    pub halted: bool,
    /// A staged copy (a learner), not a member of the set.
    pub staged: bool,
    /// Answered this generation's fence `RebuildingNeedsGeneration`: it lost its copy
    /// at this generation, and counts in no election until it verified a later one
    /// (the control plane starts one).
    pub rebuilding: bool,
}

/// A follower's state as its leader sees it.
#[derive(Debug, Clone)]
struct Cursor {
    /// Next offset to send: past every message in flight.
    next: u64,
    /// Where to send from again when the messages in flight go unanswered: the end of
    /// what it answered, or where a refusal or fence told us it stands.
    resume: u64,
    /// One past the last record it durably holds, verified at our generation.
    matched: u64,
    /// `(end, commit mark carried)` of the messages sent and not answered yet, oldest
    /// first.
    in_flight: VecDeque<(u64, u64)>,
    /// Since when it owes an answer with nothing answered (`None`: nothing in flight).
    waiting_since: Option<Instant>,
    /// A fence of ours is on its way to it: nothing else is sent until it is answered.
    fencing: bool,
    /// Our own log read for it is in flight.
    reading: bool,
    /// The highest commit mark it confirmed hearing (carried by a message it answered).
    /// Counted at the answer, not at the send: a mark lost on the network is sent again
    /// by the next heartbeat.
    told_commit: u64,
    /// Refused to cut committed records: not shipped to again.
    halted: bool,
    /// Answered our fence `RebuildingNeedsGeneration`.
    rebuilding: bool,
}

impl Cursor {
    fn new(next: u64) -> Cursor {
        Cursor {
            next,
            resume: next,
            matched: 0,
            in_flight: VecDeque::new(),
            waiting_since: None,
            fencing: false,
            reading: false,
            told_commit: 0,
            halted: false,
            rebuilding: false,
        }
    }

    /// Forgets what is in flight and sends from `at` next.
    fn restart(&mut self, at: u64) {
        self.next = at;
        self.resume = at;
        self.in_flight.clear();
        self.waiting_since = None;
        self.fencing = false;
    }

    /// Whether another message may go out now.
    fn free(&self) -> bool {
        !self.fencing && self.in_flight.len() < MAX_IN_FLIGHT
    }
}

/// A candidate: fencing a majority, then catching up from the furthest-ahead log.
#[derive(Debug)]
struct Candidate {
    replicas: Vec<NodeId>,
    /// Who accepted our fence: `(base, end, last_generation)`. Ordered maps here and in
    /// [`Leading`]: iteration order decides the order of outputs (and the source chosen
    /// among equally-ahead logs), which must not vary from process to process.
    fenced: BTreeMap<NodeId, (u64, u64, u64)>,
    fence_sent: BTreeMap<NodeId, Instant>,
    /// The log we take, and its end.
    source: Option<(NodeId, u64)>,
    /// Our log agrees with the source's up to here.
    verified: u64,
    fetch_sent: Option<Instant>,
    start_requested: bool,
    /// A planned handoff's old leader and how long its fence is waited for (see
    /// [`Assignment::handoff_from`]); None once it answered or could not.
    handoff: Option<(NodeId, Instant)>,
}

#[derive(Debug)]
struct Leading {
    replicas: Vec<NodeId>,
    /// Staged copies: shipped to, not counted.
    learners: Vec<NodeId>,
    /// Offset of this generation's start record: the commit mark counts past it only.
    start: u64,
    cursors: BTreeMap<NodeId, Cursor>,
}

#[derive(Debug)]
enum Role {
    /// Not (yet) in the replica set, or waiting for a newer assignment.
    Idle,
    Follower,
    Candidate(Candidate),
    Leader(Leading),
}

/// A batch message being applied, with the contiguous messages from its sender that
/// arrived while it was (each stored at once, so one fsync can cover several).
#[derive(Debug)]
struct Ingest {
    from: NodeId,
    generation: u64,
    /// Batches to store once the cut is done.
    rest: Vec<Batch>,
    /// One past the last record of the message (of the last one taken on).
    end: u64,
    /// The end last answered `Ok` (progress is answered as it becomes durable).
    answered: u64,
    /// The sender's commit, capped at `end`.
    commit: u64,
    /// A candidate's own fetch (no answer is sent).
    fetched: bool,
    cutting: bool,
}

/// What comparing a batch message with the local log found.
enum Compare {
    /// Refuse it.
    Refuse(Refusal, u64),
    /// Cut at `at` (None: nothing to cut), then store `rest`.
    Apply { at: Option<u64>, rest: Vec<Batch> },
}

/// One replica of one shard.
#[derive(Debug)]
pub struct Replica {
    me: NodeId,
    meta: Meta,
    /// The generation of the newest ballot write in flight: fences at it are answered
    /// only when that write (not an older one) is durable.
    persisting: Option<u64>,
    /// Fences to answer once the ballot is durable.
    pending_fence_ok: Vec<(NodeId, u64)>,
    assigned: Option<Assignment>,
    role: Role,
    log: LogView,
    commit: u64,
    ingest: Option<Ingest>,
    serving: bool,
    last_heartbeat: Option<Instant>,
    last_keepalive: Option<Instant>,
    /// A fence was answered `Rebuilding` since this replica started (see
    /// `check_ballot`).
    rebuild_announced: bool,
    out: VecDeque<Output>,
    /// A deliberately broken replica (checker mutants only): leads without fencing a
    /// majority first, and takes records from any generation.
    skip_fence: bool,
    /// `(generation, base)`: the leader of that generation said its log begins at `base`
    /// (a `Bootstrap` answered "held already"). A batch message from there whose previous
    /// generation disagrees with ours means our records from there on differ from the
    /// leader's committed ones: we start over at its base.
    leader_base: Option<(u64, u64)>,
    /// `(generation, commit)`: the highest commit mark the leader of that generation
    /// sent us. Applied up to what we verified against that leader whenever a batch
    /// message is answered, so a mark carried by a message we had to drop (busy with
    /// the one before), or by a stale resend ending below it, is not lost: the leader,
    /// having sent it, does not send it again.
    heard_commit: (u64, u64),
    /// Fences at generations newer than every assignment this replica was handed, by
    /// sender (a member of the assignment it holds; the newest of each): answered once
    /// an assignment names that sender leader at that generation, dropped once one
    /// passes it. Kept per sender, a forged fence at a generation no assignment reaches
    /// cannot push a real one out.
    early_fences: BTreeMap<NodeId, u64>,
    /// Stepped down at this generation (a newer one exists: see `step_down`), and not
    /// named anything since.
    stepped_down: Option<u64>,
}

impl Replica {
    /// A replica named `me` over a log holding `[base, end)` (all durable), whose
    /// generations begin at `epochs`, with the persisted `meta`.
    pub fn new(me: NodeId, meta: Meta, base: u64, end: u64, epochs: BTreeMap<u64, u64>) -> Replica {
        Replica {
            me,
            commit: meta.commit.min(end).max(base),
            meta,
            persisting: None,
            pending_fence_ok: Vec::new(),
            assigned: None,
            role: Role::Idle,
            log: LogView {
                base,
                end,
                durable: end,
                epochs,
                verified: (0, 0),
            },
            ingest: None,
            serving: false,
            last_heartbeat: None,
            last_keepalive: None,
            rebuild_announced: false,
            out: VecDeque::new(),
            skip_fence: false,
            leader_base: None,
            heard_commit: (0, 0),
            early_fences: BTreeMap::new(),
            stepped_down: None,
        }
    }

    /// Whether this replica may not lead `a` (see [`Meta::rebuilding`] and
    /// [`Meta::no_lead_through`]).
    fn may_not_lead(&self, a: &Assignment) -> bool {
        let alone = a.replicas.iter().all(|r| *r == self.me) && a.learners.is_empty();
        self.meta
            .rebuilding
            .is_some_and(|since| a.generation <= since)
            || (!alone && self.meta.no_lead_through.is_some_and(|g| a.generation <= g))
    }

    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// Whether this replica leads and may take writes now.
    pub fn serving(&self) -> bool {
        self.serving
    }

    /// The commit mark.
    pub fn commit(&self) -> u64 {
        self.commit
    }

    /// The generation this replica accepted.
    pub fn generation(&self) -> u64 {
        self.meta.generation
    }

    /// The local log's claimed end and durable end.
    pub fn log_end(&self) -> (u64, u64) {
        (self.log.end, self.log.durable)
    }

    /// Generation of the record at `offset` (0 when unknown).
    pub fn generation_at(&self, offset: u64) -> u64 {
        self.log.generation_at(offset)
    }

    /// Where each generation begins in the local log.
    pub fn epochs(&self) -> &BTreeMap<u64, u64> {
        &self.log.epochs
    }

    /// The durable state to persist, with the current commit mark.
    pub fn meta(&self) -> Meta {
        Meta {
            commit: self.commit,
            ..self.meta.clone()
        }
    }

    /// Whether this replica was named leader and does not serve yet: a candidate
    /// fencing a majority, catching up, or writing its generation start.
    pub fn taking_over(&self) -> bool {
        matches!(self.role, Role::Candidate(_))
            || (matches!(self.role, Role::Leader(_)) && !self.serving)
    }

    /// Whether the copy is being rebuilt (see [`Meta::rebuilding`]).
    pub fn rebuilding(&self) -> bool {
        self.meta.rebuilding.is_some()
    }

    /// Named leader at a generation this replica may not lead (its copy was lost at or
    /// after it, or a crashed unsynced life may have lost records it acknowledged), or
    /// no longer leads (it stepped down at it: a member showed it a newer one): the
    /// control plane must name another leader. In the second case it has, unless the
    /// newer generation was never assigned (a forged fence); the report makes it
    /// promote one then, where the shard would otherwise wait for an operator.
    pub fn cannot_lead(&self) -> bool {
        self.assigned.as_ref().is_some_and(|a| {
            a.leader == self.me
                && (self.may_not_lead(a)
                    || (matches!(self.role, Role::Idle) && self.stepped_down == Some(a.generation)))
        })
    }

    /// Whether this replica leads (serving or not).
    pub fn is_leader(&self) -> bool {
        matches!(self.role, Role::Leader(_))
    }

    /// The staged copies the current assignment names.
    pub fn learners(&self) -> &[NodeId] {
        self.assigned.as_ref().map_or(&[], |a| &a.learners)
    }

    /// Leading, with the commit mark past this generation's start record: every record
    /// before it is then held by a majority of the current set (log matching), which a
    /// control plane must know before it removes a member (see `placement.rs`).
    pub fn committed_in_generation(&self) -> bool {
        matches!(&self.role, Role::Leader(l) if self.commit > l.start)
    }

    /// Leading: the offset of this generation's start record.
    pub fn generation_start(&self) -> Option<u64> {
        match &self.role {
            Role::Leader(l) => Some(l.start),
            _ => None,
        }
    }

    /// Followers' positions (leader only).
    pub fn followers(&self) -> Vec<Follower> {
        match &self.role {
            Role::Leader(l) => l
                .cursors
                .iter()
                .map(|(p, c)| Follower {
                    peer: p.clone(),
                    matched: c.matched,
                    halted: c.halted,
                    staged: l.learners.contains(p),
                    rebuilding: c.rebuilding,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    fn send(&mut self, to: &NodeId, msg: Msg) {
        self.out.push_back(Output::Send {
            to: to.clone(),
            msg,
        });
    }

    /// Answers the leader of `generation` that our log agrees with its log up to `end`
    /// and holds it durably, and takes its commit mark as far as that allows.
    fn answer_ok(&mut self, to: &NodeId, generation: u64, end: u64, carried: u64) {
        let (g, v) = self.log.verified;
        self.log.verified = (generation, if g == generation { v.max(end) } else { end });
        let v = self.log.verified.1;
        if self.meta.rebuilding.is_some_and(|since| generation > since)
            && v > 0
            && self.log.generation_at(v - 1) == generation
        {
            // Verified past the start record of a generation elected without us: we
            // hold every record committed before it, and from it on we counted only
            // for what we hold.
            self.rebuilt();
        }
        let heard = match self.heard_commit {
            (g, c) if g == generation => c.min(self.log.verified.1),
            _ => 0,
        };
        let commit = carried.min(end).max(heard).min(self.log.durable);
        if commit > self.commit {
            self.commit = commit;
            self.out.push_back(Output::Commit(commit));
        }
        self.send(to, Msg::Ok { generation, end });
    }

    /// The copy is whole again: it may be counted in elections from now on.
    fn rebuilt(&mut self) {
        if self.meta.rebuilding.take().is_some() {
            self.out.push_back(Output::Persist(self.meta()));
        }
    }

    fn refuse(&mut self, to: &NodeId, code: Refusal, expected: u64) {
        let msg = Msg::Refused {
            generation: self.meta.generation,
            code,
            expected,
        };
        self.send(to, msg);
    }

    fn set_serving(&mut self, serving: bool) {
        if self.serving != serving {
            self.serving = serving;
            self.out.push_back(Output::Serving(serving));
        }
    }

    /// Stops leading (or standing) at once: a newer generation exists. Idle until an
    /// assignment says what this replica is in it, which is asked for now.
    fn step_down(&mut self) {
        self.set_serving(false);
        self.role = Role::Idle;
        self.stepped_down = Some(self.meta.generation);
        // A candidate's fetch in progress: its end must not count as verified should
        // this replica stand again (its source may not be the next one's).
        if self
            .ingest
            .as_ref()
            .is_some_and(|i| i.fetched && !i.cutting)
        {
            self.ingest = None;
        }
        self.out.push_back(Output::AssignmentWanted);
    }

    fn majority(n: usize) -> usize {
        n / 2 + 1
    }

    // ---- the control plane ----------------------------------------------------------

    /// The control plane's assignment for this shard. Older generations are ignored.
    pub fn handle_assignment(&mut self, a: Assignment, now: Instant) {
        let (generation, leader) = (a.generation, a.leader.clone());
        self.take_assignment(a, now);
        // A fence that came ahead of this assignment: answered now if it names its
        // sender; dropped once an assignment reaches its generation either way.
        let early = self.early_fences.remove(&leader);
        self.early_fences.retain(|_, g| *g > generation);
        if early == Some(generation) {
            self.on_fence(leader, generation);
        } else if let Some(g) = early.filter(|g| *g > generation) {
            self.early_fences.insert(leader, g);
        }
    }

    fn take_assignment(&mut self, a: Assignment, now: Instant) {
        if let Some(old) = &self.assigned {
            if old.generation > a.generation {
                return;
            }
            if old.generation == a.generation {
                // The same generation: only the staged copies change (the control plane
                // stages and drops them without an election; they count for nothing).
                let me = self.me.clone();
                if let Role::Leader(l) = &mut self.role {
                    for n in &a.learners {
                        if *n != me && !l.cursors.contains_key(n) {
                            // Unfenced: refused `NotFenced`, fenced, then shipped to.
                            l.cursors.insert(n.clone(), Cursor::new(l.start));
                        }
                    }
                    l.cursors
                        .retain(|n, _| a.replicas.contains(n) || a.learners.contains(n));
                    l.replicas = a.replicas.clone();
                    l.learners = a.learners.clone();
                }
                let learner = a.learners.contains(&me) && !a.replicas.contains(&me);
                if learner && matches!(self.role, Role::Idle) {
                    self.role = Role::Follower;
                }
                self.assigned = Some(a);
                self.pump(now);
                return;
            }
        }
        self.assigned = Some(a.clone());
        self.set_serving(false);
        let learner = a.learners.contains(&self.me) && !a.replicas.contains(&self.me);
        if !a.replicas.contains(&self.me) && !learner {
            self.role = Role::Idle;
            return;
        }
        if a.leader != self.me || learner {
            // (A learner never leads: an assignment naming one is refused by the
            // control plane; should one arrive, it only follows.)
            if !matches!(self.role, Role::Follower) {
                self.role = Role::Follower;
            }
            return;
        }
        let mine = self.meta.leader.as_deref() == Some(&*self.me);
        if a.generation < self.meta.generation || (a.generation == self.meta.generation && !mine) {
            // Another leader was accepted at this generation or later: leading it could
            // give it two leaders. Wait for a newer assignment.
            self.role = Role::Idle;
            return;
        }
        if self.may_not_lead(&a) {
            // Led (or followed) before the copy was lost, or before a crash of a life
            // that acknowledged unsynced records: records written under this label
            // again could differ from ones a follower holds from the lost copy or
            // tail, and followers compare by label. Wait for a newer generation (the
            // broker reports it cannot lead, see `cannot_lead`).
            self.role = Role::Idle;
            return;
        }
        self.role = Role::Candidate(Candidate {
            replicas: a.replicas.clone(),
            fenced: BTreeMap::new(),
            fence_sent: BTreeMap::new(),
            source: None,
            verified: self.commit,
            fetch_sent: None,
            start_requested: false,
            handoff: a
                .handoff_from
                .clone()
                .filter(|from| *from != self.me && a.replicas.contains(from))
                .map(|from| (from, now + HANDOFF_WAIT)),
        });
        if a.generation > self.meta.generation {
            self.accept(a.generation, self.me.clone());
        } else {
            // Our own ballot at this generation survived a restart: carry on.
            self.candidate_step(now);
        }
    }

    /// Starts persisting the ballot `(generation, leader)`; it counts once durable.
    fn accept(&mut self, generation: u64, leader: NodeId) {
        self.meta.generation = generation;
        self.meta.leader = Some(leader.to_string());
        self.persisting = Some(generation);
        self.out.push_back(Output::Persist(self.meta()));
    }

    /// An [`Output::Persist`] of the ballot at `generation` is durable (writes complete
    /// in the order they were asked for).
    pub fn handle_persisted(&mut self, generation: u64, now: Instant) {
        if self.persisting != Some(generation) {
            return;
        }
        self.persisting = None;
        for (to, generation) in std::mem::take(&mut self.pending_fence_ok) {
            if generation == self.meta.generation {
                self.answer_fence(&to);
            }
        }
        self.candidate_step(now);
    }

    fn answer_fence(&mut self, to: &NodeId) {
        if let Some(since) = self.meta.rebuilding {
            self.rebuild_announced = true;
            let durable = self.log.durable;
            let code = if since >= self.meta.generation {
                Refusal::RebuildingNeedsGeneration
            } else {
                Refusal::Rebuilding
            };
            self.refuse(to, code, durable);
            return;
        }
        let msg = Msg::FenceOk {
            generation: self.meta.generation,
            base: self.log.base,
            end: self.log.durable,
            commit: self.commit,
            last_generation: self.log.last_generation(),
        };
        self.send(to, msg);
    }

    // ---- messages ---------------------------------------------------------------------

    /// A message from `from`.
    pub fn handle_message(&mut self, from: NodeId, msg: Msg, now: Instant) {
        match msg {
            Msg::Fence { generation } => self.on_fence(from, generation),
            Msg::FenceOk {
                generation,
                base,
                end,
                commit,
                last_generation,
            } => self.on_fence_ok(from, generation, (base, end, commit, last_generation), now),
            Msg::Fetch {
                generation,
                from: at,
            } => self.on_fetch(from, generation, at),
            Msg::Records {
                generation,
                from: at,
                prev_generation,
                commit,
                batches,
                fetched,
            } => self.on_records(
                from,
                generation,
                (at, prev_generation),
                commit,
                batches,
                fetched,
                now,
            ),
            Msg::Ok { generation, end } => self.on_ok(from, generation, end, now),
            Msg::Refused {
                generation,
                code,
                expected,
            } => self.on_refused(from, generation, code, expected, now),
            Msg::Bootstrap { generation, base } => self.on_bootstrap(from, generation, base),
        }
    }

    /// Breaks fencing on purpose: this replica then leads on its own log without
    /// fencing a majority, and takes records from deposed leaders. Only the checker's mutant runs call it, to show the simulator and the
    /// chaos checker catch the bug.
    pub fn break_fencing_for_mutant_runs(&mut self) {
        self.skip_fence = true;
    }

    /// Whether `leader` at `generation` is the ballot this replica accepted.
    fn check_ballot(&self, leader: &NodeId, generation: u64) -> Result<(), Refusal> {
        if self.skip_fence && generation <= self.meta.generation {
            return Ok(());
        }
        if generation < self.meta.generation
            || (generation == self.meta.generation
                && self.meta.leader.as_deref() != Some(&**leader))
        {
            return Err(Refusal::Fenced);
        }
        if generation > self.meta.generation || self.persisting.is_some() {
            return Err(Refusal::NotFenced);
        }
        if !self.rebuild_announced
            && self
                .meta
                .rebuilding
                .is_some_and(|since| generation <= since)
        {
            // Lost our copy while following this leader: it must learn that (a fence
            // answered `Rebuilding`), so the control plane starts a generation we can
            // be whole again at.
            return Err(Refusal::NotFenced);
        }
        Ok(())
    }

    fn on_fence(&mut self, from: NodeId, generation: u64) {
        if generation < self.meta.generation
            || (generation == self.meta.generation && self.meta.leader.as_deref() != Some(&*from))
        {
            self.refuse(&from, Refusal::Fenced, 0);
            return;
        }
        if generation == self.meta.generation {
            if self.persisting.is_some() {
                self.pending_fence_ok.push((from, generation));
            } else {
                self.answer_fence(&from);
            }
            return;
        }
        // A newer generation, taken only from the leader the control plane named at it:
        // anyone holding a node token could otherwise fence every replica at a made-up
        // generation, and the persisted ballot would refuse every real leader after it.
        match &self.assigned {
            Some(a) if a.generation == generation && a.leader == from => {}
            // Named another leader, or passed already: a stale or forged fence.
            Some(a) if a.generation >= generation => return,
            // Not handed that assignment yet (the control plane's feed reaches brokers
            // a few milliseconds apart): kept until it is, from a member of the
            // assignment held (a new leader is one), or from anyone while none is held
            // (one sender then).
            assigned => {
                let member = assigned.as_ref().is_none_or(|a| {
                    a.leader == from || a.replicas.contains(&from) || a.learners.contains(&from)
                });
                if assigned.is_none() && !self.early_fences.contains_key(&from) {
                    self.early_fences.clear();
                }
                if member {
                    let g = self.early_fences.entry(from).or_insert(generation);
                    *g = (*g).max(generation);
                    if matches!(self.role, Role::Leader(_) | Role::Candidate(_)) {
                        // A member fences only at a generation the control plane named
                        // it leader of: ours is over, whether or not our feed said so
                        // yet. Led on until it did (a planned handoff to a node whose
                        // feed lags), this replica went on acknowledging `Leader`
                        // writes and answering lease reads beside the new leader, which
                        // takes a majority without it after `HANDOFF_WAIT`.
                        self.step_down();
                    }
                }
                return;
            }
        }
        // A newer generation: stop leading or following the old one now; answer once
        // the ballot is durable.
        if matches!(self.role, Role::Leader(_) | Role::Candidate(_)) {
            self.role = Role::Follower;
        }
        self.set_serving(false);
        self.ingest = None;
        self.accept(generation, from.clone());
        self.pending_fence_ok.push((from, generation));
    }

    fn on_fence_ok(
        &mut self,
        from: NodeId,
        generation: u64,
        (base, end, commit, last_generation): (u64, u64, u64, u64),
        now: Instant,
    ) {
        if generation != self.meta.generation {
            return;
        }
        match &mut self.role {
            Role::Candidate(c) => {
                c.fenced.insert(from, (base, end, last_generation));
                // Below a fenced replica's commit every log agrees.
                let _ = commit;
                self.candidate_step(now);
            }
            Role::Leader(l) => {
                // A follower fenced again (it had missed our fence): ship from its end.
                if let Some(cur) = l.cursors.get_mut(&from) {
                    cur.restart(end.max(base).min(self.log.durable));
                }
                self.pump(now);
            }
            _ => {}
        }
    }

    fn on_fetch(&mut self, from: NodeId, generation: u64, at: u64) {
        if let Err(code) = self.check_ballot(&from, generation) {
            self.refuse(&from, code, 0);
            return;
        }
        self.out.push_back(Output::Read {
            to: from,
            from: at.max(self.log.base),
            fetch: true,
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn on_records(
        &mut self,
        from: NodeId,
        generation: u64,
        prev: (u64, u64),
        commit: u64,
        batches: Vec<Batch>,
        fetched: bool,
        now: Instant,
    ) {
        if fetched {
            // The answer to a candidate's own fetch, from the source it chose.
            let ours = match &self.role {
                Role::Candidate(c) => {
                    generation == self.meta.generation
                        && c.source.as_ref().is_some_and(|(p, _)| *p == from)
                }
                _ => false,
            };
            if ours && self.ingest.is_none() {
                if let Role::Candidate(c) = &mut self.role {
                    c.fetch_sent = None;
                }
                self.ingest(from, generation, prev, commit, batches, true, now);
            }
            return;
        }
        if let Err(code) = self.check_ballot(&from, generation) {
            self.refuse(&from, code, 0);
            return;
        }
        if !matches!(self.role, Role::Follower | Role::Idle) {
            self.refuse(&from, Refusal::Fenced, 0);
            return;
        }
        if self.heard_commit.0 != generation || commit > self.heard_commit.1 {
            self.heard_commit = (generation, commit);
        }
        // Taken at once as far as this log was verified against that leader: a heartbeat
        // that arrives while we apply a message is not answered by itself.
        let (vg, v) = self.log.verified;
        let heard = self.heard_commit.1.min(v).min(self.log.durable);
        if vg == generation && heard > self.commit {
            self.commit = heard;
            self.out.push_back(Output::Commit(heard));
        }
        if let Some(ing) = &mut self.ingest {
            let (first, prev_generation) = prev;
            // The next message from the same leader, starting where the last one taken
            // on ends and agreeing on the record before it: stored at once, behind it.
            // (Everything up to `first` was compared already, so equal generations at
            // `first - 1` make this the same log, as in `compare`.)
            let continues = !ing.fetched
                && !ing.cutting
                && ing.rest.is_empty()
                && ing.from == from
                && ing.generation == generation
                && first == ing.end
                && first == self.log.end
                && first > self.log.base
                && prev_generation == self.log.generation_at(first - 1)
                && batches.first().is_some_and(|b| b.base == first);
            if continues {
                let end = batches.last().map_or(first, Batch::end);
                ing.end = end;
                ing.commit = ing.commit.max(commit.min(end));
                self.log.observe(&batches);
                self.out.push_back(Output::Store(batches));
                return;
            }
            // Anything else waits for the message in progress; the leader resends after
            // its timeout. Keep the commit mark it carries, though: an idle leader does
            // not send it again. (Capped at the messages being applied: that prefix is
            // verified against this leader.)
            if !ing.fetched && ing.generation == generation {
                ing.commit = ing.commit.max(commit.min(ing.end));
            }
            return;
        }
        self.ingest(from, generation, prev, commit, batches, false, now);
    }

    /// The follower's tail check: compares a batch message with the local log.
    fn compare(&self, (first, prev_generation): (u64, u64), batches: &[Batch]) -> Compare {
        let log = &self.log;
        if batches.first().is_some_and(|b| b.base != first) {
            return Compare::Refuse(Refusal::Mismatch, self.commit.max(log.base));
        }
        if first > log.durable {
            return Compare::Refuse(Refusal::Gap, log.durable);
        }
        // A message from the sender's base cannot vouch for the record before it: fine
        // when ours there is committed (equal everywhere), but an uncommitted one may
        // differ, and so may the records after it, whose batches need not even start
        // where the sender's do. Refused: a candidate's fetch then starts over at the
        // sender's base, and a follower is bootstrapped there (the leader, sent below
        // its base, answers `Bootstrap`). (Applying it cut a stale log in the middle of
        // a batch: simulator seed 108,351, a staged copy bootstrapped at its leader's
        // base and later the source of a lagging candidate's election.)
        if first > log.base && prev_generation == BELOW_BASE && first > self.commit {
            return Compare::Refuse(Refusal::Mismatch, first - 1);
        }
        // The record before the first must agree, unless it is below our base or the
        // sender's (then it is committed, and equal everywhere).
        if first > log.base && prev_generation != BELOW_BASE {
            let ours = log.generation_at(first - 1);
            if ours != prev_generation {
                let back = log.epoch_start(first - 1).max(self.commit).max(log.base);
                return Compare::Refuse(Refusal::Mismatch, back.min(first - 1));
            }
        }
        // Walk what we hold already: equal generations at equal offsets are equal records.
        let mut generation = prev_generation;
        let mut rest = Vec::new();
        let mut at = None;
        for b in batches {
            if let BatchKind::GenerationStart(g) = b.kind {
                generation = g;
            }
            if at.is_none() && b.base < log.durable {
                if b.base < log.base {
                    continue;
                }
                let starts_here = log.epochs.get(&b.base).copied();
                let theirs_start = matches!(b.kind, BatchKind::GenerationStart(_));
                let same = log.generation_at(b.base) == generation
                    && starts_here.is_some() == theirs_start;
                if same {
                    continue;
                }
                at = Some(b.base);
            }
            rest.push(b.clone());
        }
        if at.is_none() {
            rest.retain(|b| b.base >= log.durable);
        }
        Compare::Apply { at, rest }
    }

    #[allow(clippy::too_many_arguments)]
    fn ingest(
        &mut self,
        from: NodeId,
        generation: u64,
        prev: (u64, u64),
        commit: u64,
        batches: Vec<Batch>,
        fetched: bool,
        now: Instant,
    ) {
        if self.log.end > self.log.durable {
            // Our own appends (from when we led) are still on their way to the disk:
            // compare once they are there. The sender asks again.
            return;
        }
        // A message starting at our base names the generation of the record before it,
        // which this log no longer holds (removed below the commit mark, or never held
        // after a bootstrap): remember it, so records at the base compare by generation
        // like any others. (Recorded one below the base: no record starts there.)
        let (first, prev_generation) = prev;
        if first >= self.log.base
            && first > 0
            && first - 1 < self.commit.max(self.log.base)
            && prev_generation != BELOW_BASE
            && prev_generation != 0
            && self.log.epochs.range(..first).next_back().is_none()
        {
            self.log.epochs.insert(first - 1, prev_generation);
            let keep = self.epochs_through(first);
            self.out.push_back(Output::KeepEpochs(keep));
        }
        // A message starting below our base (we were bootstrapped at the leader's base,
        // past where the sender resumed) names, with its batches below the base, the
        // generation of the record just before the base: committed, equal everywhere.
        // Without it this log took its records for generation 0, reported so in a later
        // election, lost it to a shorter log, and committed records were cut
        // (simulator seed 302,925).
        let base = self.log.base;
        if first < base
            && prev_generation != BELOW_BASE
            && batches.iter().any(|b| b.end() >= base)
            && self.log.epochs.range(..base).next_back().is_none()
        {
            let mut at_base = prev_generation;
            for b in batches.iter().take_while(|b| b.base < base) {
                if let BatchKind::GenerationStart(g) = b.kind {
                    at_base = g;
                }
            }
            if at_base != 0 {
                self.log.epochs.insert(base - 1, at_base);
                let keep = self.epochs_through(base);
                self.out.push_back(Output::KeepEpochs(keep));
            }
        }
        // An empty message (a commit heartbeat) verifies only what precedes it.
        let end = batches.last().map_or(prev.0, Batch::end);
        match self.compare(prev, &batches) {
            Compare::Refuse(_, _)
                if (fetched && first > self.fetch_from() && first <= commit)
                    || (!fetched && self.leader_base == Some((generation, first))) =>
            {
                // What the sender has starts at its base, past records of ours that it
                // removed (committed, so equal everywhere) or that differ from its
                // committed ones (and so, by log matching, everything of ours after
                // them does too): start over, empty, at its base.
                self.start_over_at(
                    first,
                    Ingest {
                        from,
                        generation,
                        rest: batches,
                        end,
                        answered: first,
                        commit: commit.min(end),
                        fetched,
                        cutting: true,
                    },
                );
                if prev_generation != BELOW_BASE && prev_generation != 0 {
                    self.log.epochs.insert(first - 1, prev_generation);
                    let keep = self.epochs_through(first);
                    self.out.push_back(Output::KeepEpochs(keep));
                }
            }
            Compare::Refuse(code, expected) => {
                if fetched {
                    if let Role::Candidate(c) = &mut self.role {
                        c.verified = expected.min(c.verified);
                    }
                    self.candidate_step(now);
                } else {
                    self.refuse(&from, code, expected);
                }
            }
            Compare::Apply { at, rest } => {
                if let Some(at) = at
                    && at < self.commit
                {
                    // Would rewrite committed records: never.
                    if fetched {
                        self.candidate_step(now);
                    } else {
                        let commit = self.commit;
                        self.refuse(&from, Refusal::BelowCommit, commit);
                    }
                    return;
                }
                self.ingest = Some(Ingest {
                    from,
                    generation,
                    rest,
                    end,
                    answered: first,
                    commit: commit.min(end),
                    fetched,
                    cutting: at.is_some(),
                });
                match at {
                    Some(at) => {
                        self.log.cut(at);
                        self.out.push_back(Output::Truncate { from: at });
                    }
                    None => self.store(now),
                }
            }
        }
    }

    fn store(&mut self, now: Instant) {
        let Some(ing) = &mut self.ingest else { return };
        let rest = std::mem::take(&mut ing.rest);
        if !rest.is_empty() {
            self.log.observe(&rest);
            self.out.push_back(Output::Store(rest));
        }
        self.finish_ingest(now);
    }

    /// Answers the batch messages in progress as their records become durable, and
    /// ends the ingest once all are.
    fn finish_ingest(&mut self, now: Instant) {
        let Some(ing) = &mut self.ingest else { return };
        if ing.cutting {
            return;
        }
        let durable = self.log.durable;
        if durable < ing.end.min(self.log.end) {
            // Part of it is durable: say so now, so the leader's commit mark (and its
            // window of messages in flight) need not wait for the rest.
            let progress = ing.end.min(durable);
            if !ing.fetched && progress > ing.answered {
                ing.answered = progress;
                let (to, generation, carried) = (ing.from.clone(), ing.generation, ing.commit);
                self.answer_ok(&to, generation, progress, carried);
            }
            return;
        }
        let ing = self.ingest.take().expect("checked above");
        let end = ing.end.min(self.log.durable);
        if ing.fetched {
            if let Role::Candidate(c) = &mut self.role {
                c.verified = c.verified.max(end);
            }
            self.candidate_step(now);
        } else {
            self.answer_ok(&ing.from, ing.generation, end, ing.commit);
        }
    }

    fn on_bootstrap(&mut self, from: NodeId, generation: u64, base: u64) {
        if let Err(code) = self.check_ballot(&from, generation) {
            self.refuse(&from, code, 0);
            return;
        }
        if self.ingest.is_some() {
            return;
        }
        if self.log.base <= base && base <= self.log.durable {
            // We hold the leader's base already. (If our record before it differs from
            // the leader's, the batch message from the base says so: see `leader_base`.)
            self.leader_base = Some((generation, base));
            self.send(
                &from,
                Msg::Ok {
                    generation,
                    end: base,
                },
            );
            return;
        }
        if base < self.log.base && self.commit >= self.log.base {
            // Our log begins past the leader's base (a later bootstrap moved it, or our
            // own retention): everything below our base is committed, and we hold the
            // rest. A duplicated or delayed bootstrap from before ours lands here;
            // refusing it `BelowCommit` halted this follower for the rest of the
            // generation (the simulator's lost-copy runs, whose rebuilt copies are all
            // bootstrapped, found it once the heal stopped starting a new generation).
            let at = self.log.base;
            self.send(
                &from,
                Msg::Ok {
                    generation,
                    end: at,
                },
            );
            return;
        }
        if self.commit > base {
            let commit = self.commit;
            self.refuse(&from, Refusal::BelowCommit, commit);
            return;
        }
        // Everything we hold is below the leader's base: start over, empty, at it.
        self.start_over_at(
            base,
            Ingest {
                from,
                generation,
                rest: Vec::new(),
                end: base,
                answered: base,
                commit: base,
                fetched: false,
                cutting: true,
            },
        );
    }

    /// Drops the whole log and starts it over, empty, at `base` (everything below is
    /// committed and gone at the sender), then stores what `ingest` carries. What we
    /// knew of generations below the new base is stale.
    fn start_over_at(&mut self, base: u64, ingest: Ingest) {
        self.ingest = Some(ingest);
        let old = self.log.base;
        self.log.cut(old);
        self.log.epochs.clear();
        self.log.base = base;
        self.log.end = base;
        self.log.durable = base;
        self.commit = self.commit.max(base);
        self.out.push_back(Output::ResetAt { base });
    }

    // ---- local log events -------------------------------------------------------------

    /// Local storage failed to carry out a [`Output::Store`], [`Output::Truncate`] or
    /// [`Output::ResetAt`]: the batch message in progress is abandoned (its sender asks
    /// again) and the log's end is taken from storage.
    pub fn handle_failed(&mut self, end: u64, durable: u64, now: Instant) {
        let fetched = self.ingest.take().is_some_and(|i| i.fetched);
        self.log.cut(end);
        self.log.durable = durable.min(end);
        if fetched {
            if let Role::Candidate(c) = &mut self.role {
                c.fetch_sent = None;
            }
            self.candidate_step(now);
        }
    }

    /// A cut or reset requested with [`Output::Truncate`] or [`Output::ResetAt`] is
    /// done.
    pub fn handle_truncated(&mut self, now: Instant) {
        let Some(ing) = &mut self.ingest else { return };
        if !ing.cutting {
            return;
        }
        ing.cutting = false;
        self.store(now);
    }

    /// A leader's own append claimed `[first, end)`. False (claim nothing) when this
    /// replica may not take writes or the offsets are not its log's end.
    ///
    /// Records are shipped only once durable here. Shipping at the claim would let
    /// followers hold records this leader loses in a crash; restarted, it leads its own
    /// generation again and writes other records at those offsets under the same
    /// generation label, which followers compare by (found by the simulator: acked
    /// records overwritten). Doing it safely needs labels that tell a leader's lives
    /// apart (see docs/replication.md).
    pub fn handle_appended(&mut self, first: u64, end: u64) -> bool {
        if !self.serving || first != self.log.end {
            return false;
        }
        self.log.end = end;
        true
    }

    /// Storage removed the records below `base` (retention or a cache compaction's cut;
    /// only ever committed ones): a follower whose log ends below it is bootstrapped
    /// from here. Epoch entries below the base stay (one per generation; the one that
    /// covers the base is still needed).
    pub fn handle_base(&mut self, base: u64) {
        if base > self.log.base && base <= self.log.durable.min(self.commit) {
            self.log.base = base;
        }
    }

    /// Where a candidate asks its source for records: a fetch answered from further on
    /// starts at the source's base (it no longer holds what we asked for).
    fn fetch_from(&self) -> u64 {
        match &self.role {
            Role::Candidate(c) => c.verified.max(self.log.base).min(self.log.durable),
            _ => u64::MAX,
        }
    }

    /// The generation starts a restart needs from outside the log once the records
    /// below `upto` are gone: the one in force at the log's base, and every later one
    /// up to `upto`. Kept (see [`Output::KeepEpochs`]) before a prefix is removed.
    pub fn epochs_through(&self, upto: u64) -> Vec<(u64, u64)> {
        let from = self
            .log
            .epochs
            .range(..=self.log.base)
            .next_back()
            .map_or(0, |(o, _)| *o);
        self.log
            .epochs
            .range(from..=upto)
            .map(|(o, g)| (*o, *g))
            .collect()
    }

    /// Writing this candidate's generation-start record failed before it was claimed:
    /// it is asked for again at the next timer.
    pub fn handle_generation_start_failed(&mut self) {
        if let Role::Candidate(c) = &mut self.role {
            c.start_requested = false;
        }
    }

    /// This replica's generation-start record was claimed at `start`.
    pub fn handle_generation_start(&mut self, start: u64) {
        let generation = self.meta.generation;
        self.log.epochs.insert(start, generation);
        self.log.end = self.log.end.max(start + 1);
    }

    /// The local log is durable up to `end`.
    pub fn handle_durable(&mut self, end: u64, now: Instant) {
        // Never past what this replica claimed: a store that completes after a cut of
        // its records (it was claimed before the cut) reports an end they no longer
        // have.
        let end = end.min(self.log.end);
        if end <= self.log.durable {
            return;
        }
        self.log.durable = end;
        match &self.role {
            Role::Leader(_) => {
                self.advance_commit();
                self.pump(now);
            }
            Role::Candidate(c) if c.start_requested && self.ingest.is_none() => {
                self.candidate_step(now)
            }
            _ => self.finish_ingest(now),
        }
    }

    /// Batches read from `from` for `to` by an [`Output::Read`] (empty: nothing there,
    /// or below the log's base).
    pub fn handle_read(
        &mut self,
        to: NodeId,
        asked: u64,
        batches: Vec<Batch>,
        fetch: bool,
        now: Instant,
    ) {
        // A candidate fetching below our base gets what we hold from the base on (what
        // is below it is committed; the candidate starts over there).
        let mut batches = batches;
        let asked = if fetch && asked < self.log.base {
            batches.retain(|b| b.base >= self.log.base);
            self.log.base
        } else {
            asked
        };
        // A read starts at the batch holding the offset asked for.
        let from = batches.first().map_or(asked, |b| b.base.min(asked));
        // At or below our base the record before is gone; its generation is still known
        // when the epoch covering it is (kept when a prefix is removed).
        let prev_generation = match (from, self.log.generation_at(from.saturating_sub(1))) {
            (0, _) => 0,
            (_, g) if from > self.log.base || g != 0 => g,
            _ => BELOW_BASE,
        };
        let generation = self.meta.generation;
        let commit = self.commit;
        if fetch {
            self.send(
                &to,
                Msg::Records {
                    generation,
                    from,
                    prev_generation,
                    commit,
                    batches,
                    fetched: true,
                },
            );
            return;
        }
        let base = self.log.base;
        let Role::Leader(l) = &mut self.role else {
            return;
        };
        let Some(cur) = l.cursors.get_mut(&to) else {
            return;
        };
        cur.reading = false;
        if asked != cur.next || !cur.free() {
            self.pump(now);
            return;
        }
        if cur.in_flight.is_empty() {
            cur.waiting_since = Some(now);
        }
        if from < base {
            cur.in_flight.push_back((base, 0));
            self.send(&to, Msg::Bootstrap { generation, base });
            return;
        }
        // Only what is durable here is shipped (see `handle_appended`).
        let durable = self.log.durable;
        let mut batches = batches;
        batches.retain(|b| b.end() <= durable);
        let end = batches.last().map_or(from, Batch::end);
        cur.in_flight.push_back((end, commit));
        cur.next = cur.next.max(end);
        self.send(
            &to,
            Msg::Records {
                generation,
                from,
                prev_generation,
                commit,
                batches,
                fetched: false,
            },
        );
    }

    // ---- candidate ------------------------------------------------------------------

    /// Moves a candidate on: fence a majority, take the furthest-ahead log, append the
    /// generation's start record, then lead.
    fn candidate_step(&mut self, now: Instant) {
        if self.persisting.is_some() || self.ingest.is_some() {
            return;
        }
        let generation = self.meta.generation;
        let me = self.me.clone();
        let mine = (self.log.base, self.log.durable, self.log.last_generation());
        let Role::Candidate(c) = &mut self.role else {
            return;
        };
        c.fenced.insert(me.clone(), mine);
        let mut fences = Vec::new();
        for r in &c.replicas {
            if *r == me || c.fenced.contains_key(r) {
                continue;
            }
            if c.fence_sent
                .get(r)
                .is_none_or(|at| now.duration_since(*at) >= RESEND_AFTER)
            {
                c.fence_sent.insert(r.clone(), now);
                fences.push(r.clone());
            }
        }
        // A rebuilding candidate's own log may lack records it acknowledged before its
        // copy was lost: the majority is counted over the others (its log still
        // competes as a source: whatever it holds it took from a leader).
        let counted = c.fenced.len() - usize::from(self.meta.rebuilding.is_some());
        let enough = self.skip_fence || counted >= Self::majority(c.replicas.len());
        for r in fences {
            self.send(&r, Msg::Fence { generation });
        }
        if !enough {
            return;
        }
        let Role::Candidate(c) = &mut self.role else {
            return;
        };
        if let Some((from, until)) = &c.handoff
            && !c.fenced.contains_key(from)
            && now < *until
            && c.source.is_none()
        {
            // A planned handoff: the old leader's log is the one sure to hold what it
            // acknowledged without waiting for followers.
            return;
        }
        if c.source.is_none() {
            // The furthest-ahead log: by the generation of its last record, then its
            // length; ours on a tie (nothing to fetch).
            let (node, (_, end, _)) = c
                .fenced
                .iter()
                .max_by_key(|(n, (_, end, last))| (*last, *end, **n == me))
                .map(|(n, v)| (n.clone(), *v))
                .expect("a majority is not empty");
            c.source = Some((node, end));
        }
        let (source, target) = c.source.clone().expect("chosen above");
        if !c.start_requested {
            if source != me && c.verified < target {
                if c.fetch_sent
                    .is_none_or(|at| now.duration_since(at) >= RESEND_AFTER)
                {
                    c.fetch_sent = Some(now);
                    let from = c.verified.max(self.log.base).min(self.log.durable);
                    debug_assert_eq!(from, self.fetch_from());
                    self.send(&source, Msg::Fetch { generation, from });
                }
                return;
            }
            if source != me && self.log.durable > target {
                // Records past the best log are in no majority: not committed, cut them.
                self.ingest = Some(Ingest {
                    from: me,
                    generation,
                    rest: Vec::new(),
                    end: target,
                    answered: target,
                    commit: 0,
                    fetched: true,
                    cutting: true,
                });
                self.log.cut(target);
                self.out.push_back(Output::Truncate { from: target });
                return;
            }
            c.start_requested = true;
            self.out
                .push_back(Output::AppendGenerationStart { generation });
            return;
        }
        let start = self
            .log
            .epochs
            .iter()
            .rev()
            .find(|(_, g)| **g == generation)
            .map(|(o, _)| *o);
        let Some(start) = start.filter(|s| self.log.durable > *s) else {
            return;
        };
        let Role::Candidate(c) = std::mem::replace(&mut self.role, Role::Idle) else {
            unreachable!("a candidate, matched above")
        };
        let learners = self
            .assigned
            .as_ref()
            .filter(|a| a.generation == generation)
            .map(|a| a.learners.clone())
            .unwrap_or_default();
        // Learners were not fenced: their first message is refused `NotFenced`, and
        // they are fenced then, as a follower that missed the election is.
        let cursors = c
            .replicas
            .iter()
            .chain(learners.iter())
            .filter(|r| **r != me)
            .map(|r| {
                let end = c.fenced.get(r).map_or(start, |v| v.1);
                (r.clone(), Cursor::new(end.min(start)))
            })
            .collect();
        self.role = Role::Leader(Leading {
            replicas: c.replicas,
            learners,
            start,
            cursors,
        });
        // Elected by a majority of the others, it took every committed record.
        self.rebuilt();
        self.set_serving(true);
        self.advance_commit();
        self.pump(now);
    }

    // ---- leader ---------------------------------------------------------------------

    fn on_ok(&mut self, from: NodeId, generation: u64, end: u64, now: Instant) {
        if generation != self.meta.generation {
            return;
        }
        let Role::Leader(l) = &mut self.role else {
            return;
        };
        let Some(cur) = l.cursors.get_mut(&from) else {
            return;
        };
        // A follower holds nothing this leader has not made durable and shipped: an
        // answer claiming more (a reply to a request of another shard or another life
        // of this process, its correlation id reused) counts no further than that.
        let end = end.min(self.log.durable);
        let progressed = end > cur.matched || cur.in_flight.front().is_some_and(|(e, _)| *e <= end);
        cur.matched = cur.matched.max(end);
        cur.next = cur.next.max(end);
        cur.resume = cur.resume.max(end);
        while let Some((_, told)) = cur.in_flight.pop_front_if(|(e, _)| *e <= end) {
            cur.told_commit = cur.told_commit.max(told);
        }
        if progressed && !cur.fencing {
            // (A fence of ours still owes its answer: its timer keeps running.)
            cur.waiting_since = (!cur.in_flight.is_empty()).then_some(now);
        }
        self.advance_commit();
        self.pump(now);
    }

    fn on_refused(
        &mut self,
        from: NodeId,
        generation: u64,
        code: Refusal,
        expected: u64,
        now: Instant,
    ) {
        if code == Refusal::Fenced {
            // A newer generation was accepted there: someone else leads now, stop at
            // once. (At our own generation it can only answer a request we sent under
            // an older one: stale.)
            if generation > self.meta.generation
                && matches!(self.role, Role::Leader(_) | Role::Candidate(_))
            {
                self.step_down();
            }
            return;
        }
        if generation > self.meta.generation {
            return;
        }
        let my_generation = self.meta.generation;
        let (base, durable) = (self.log.base, self.log.durable);
        match &mut self.role {
            Role::Candidate(c)
                if matches!(
                    code,
                    Refusal::NotFenced | Refusal::Rebuilding | Refusal::RebuildingNeedsGeneration
                ) =>
            {
                // A replica counted as fenced that now refuses (a refused fetch, or an
                // answer to a fence sent again): it restarted since its `FenceOk`, and
                // may have lost its copy meanwhile. It no longer counts, and a source
                // it was stops being one (we fetch again from the commit mark). (Without
                // this a candidate whose source lost its copy waited for it forever.)
                let was_source = c.source.as_ref().is_some_and(|(s, _)| *s == from);
                if code != Refusal::NotFenced
                    && c.handoff.as_ref().is_some_and(|(old, _)| *old == from)
                {
                    // The old leader lost its copy: nothing of it to wait for.
                    c.handoff = None;
                }
                if c.fenced.remove(&from).is_some() && was_source && !c.start_requested {
                    c.source = None;
                    c.fetch_sent = None;
                    c.verified = c.verified.min(self.commit);
                }
                if code == Refusal::NotFenced {
                    c.fence_sent.remove(&from);
                }
                self.candidate_step(now);
            }
            Role::Leader(l) => {
                let Some(cur) = l.cursors.get_mut(&from) else {
                    return;
                };
                // Whatever else is in flight follows the refused message: start over.
                match code {
                    // Below our base: the read finds nothing there, and the follower is
                    // bootstrapped at the base.
                    Refusal::Gap | Refusal::Mismatch => cur.restart(expected),
                    Refusal::Bootstrap => cur.restart(base),
                    // Fenced, not counted: ship from its end as after a `FenceOk`. What
                    // it held before it lost its copy is gone: its position is its end.
                    Refusal::Rebuilding | Refusal::RebuildingNeedsGeneration => {
                        cur.rebuilding = code == Refusal::RebuildingNeedsGeneration;
                        cur.matched = cur.matched.min(expected);
                        cur.restart(expected.max(base).min(durable));
                    }
                    Refusal::NotFenced => {
                        cur.restart(cur.resume);
                        cur.fencing = true;
                        cur.waiting_since = Some(now);
                        self.send(
                            &from,
                            Msg::Fence {
                                generation: my_generation,
                            },
                        );
                        return;
                    }
                    Refusal::BelowCommit => {
                        if !cur.halted {
                            cur.halted = true;
                            self.out.push_back(Output::Halted { peer: from });
                        }
                        return;
                    }
                    Refusal::Unavailable | Refusal::Fenced => cur.restart(cur.resume),
                }
                self.pump(now);
            }
            _ => {}
        }
    }

    /// The highest offset a majority (leader counted) holds durably at this generation,
    /// counted only past this generation's start record.
    fn advance_commit(&mut self) {
        let Role::Leader(l) = &self.role else { return };
        let mut held: Vec<u64> = l
            .replicas
            .iter()
            .map(|r| {
                if *r == self.me {
                    self.log.durable
                } else {
                    l.cursors.get(r).map_or(0, |c| c.matched)
                }
            })
            .collect();
        held.sort_unstable_by(|a, b| b.cmp(a));
        let candidate = held[Self::majority(held.len()) - 1];
        if candidate > l.start && candidate > self.commit {
            self.commit = candidate;
            self.out.push_back(Output::Commit(candidate));
        }
    }

    /// Ships to every free follower what is durable here, and tells idle ones the
    /// commit mark now and then.
    fn pump(&mut self, now: Instant) {
        let durable = self.log.durable;
        let commit = self.commit;
        let heartbeat = self
            .last_heartbeat
            .is_none_or(|t| now.duration_since(t) >= COMMIT_HEARTBEAT);
        let keepalive = self
            .last_keepalive
            .is_none_or(|t| now.duration_since(t) >= KEEPALIVE);
        let Role::Leader(l) = &mut self.role else {
            return;
        };
        let mut reads = Vec::new();
        for (peer, cur) in &mut l.cursors {
            if cur.halted || cur.reading {
                continue;
            }
            if let Some(at) = cur.waiting_since
                && now.duration_since(at) >= RESEND_AFTER
            {
                // Unanswered (lost, or dropped by a busy follower): send again from
                // what it last confirmed.
                cur.restart(cur.resume);
            }
            if !cur.free() {
                continue;
            }
            // `matched < next` with nothing in flight: where it stands is unverified
            // (e.g. it fenced again and we moved `next` to its end): probe, even with
            // nothing new to ship.
            if cur.next < durable
                || (cur.in_flight.is_empty()
                    && (cur.matched < cur.next
                        || (heartbeat && cur.told_commit < commit)
                        || keepalive))
            {
                cur.reading = true;
                reads.push((peer.clone(), cur.next));
            }
        }
        if heartbeat {
            self.last_heartbeat = Some(now);
        }
        if keepalive {
            self.last_keepalive = Some(now);
        }
        for (to, from) in reads {
            self.out.push_back(Output::Read {
                to,
                from,
                fetch: false,
            });
        }
    }

    /// Timers: resend fences, fetches and batches that went unanswered.
    pub fn handle_timeout(&mut self, now: Instant) {
        match &self.role {
            Role::Candidate(_) => self.candidate_step(now),
            Role::Leader(_) => self.pump(now),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    //! The pipelined shipping path on two replicas, step by step, with the follower's
    //! disk under the test's control (the simulator covers faults; this pins down what
    //! a healthy pipeline does).

    use std::collections::{BTreeMap, VecDeque};
    use std::time::Instant;

    use bytes::Bytes;

    use super::*;

    /// A replica and the log it stores to. Stores become durable only when the test
    /// says so (`sync`), except while `auto_sync` is on.
    struct Node {
        replica: Replica,
        batches: Vec<Batch>,
        durable: u64,
        auto_sync: bool,
        /// Stores asked for: (base, end) of each message's batches.
        stores: Vec<(u64, u64)>,
    }

    impl Node {
        fn end(&self) -> u64 {
            self.batches.last().map_or(0, Batch::end)
        }
    }

    struct Pair {
        nodes: BTreeMap<NodeId, Node>,
        wire: VecDeque<(NodeId, NodeId, Msg)>,
        now: Instant,
        /// Messages to or from this node are lost.
        cut_off: Option<NodeId>,
    }

    /// Three replicas, a leading generation 1 with three records committed.
    fn three_led_by_a() -> Pair {
        let mut p = Pair::of(&["a", "b", "c"]);
        p.assign(1, "a");
        p.settle();
        p.append(3);
        p.settle();
        p
    }

    /// Carries out `r`'s outputs (a ballot is durable at once) and returns the fence
    /// answers it sent: `(to, generation, end)`.
    fn fence_answers(r: &mut Replica, now: Instant) -> Vec<(NodeId, u64, u64)> {
        let mut answers = Vec::new();
        while let Some(out) = r.poll_output() {
            match out {
                Output::Persist(meta) => r.handle_persisted(meta.generation, now),
                Output::Send {
                    to,
                    msg:
                        Msg::FenceOk {
                            generation, end, ..
                        },
                } => answers.push((to, generation, end)),
                _ => {}
            }
        }
        answers
    }

    fn id(s: &str) -> NodeId {
        NodeId::from(s)
    }

    impl Pair {
        fn new() -> Pair {
            Pair::of(&["a", "b"])
        }

        fn of(names: &[&str]) -> Pair {
            let mut nodes = BTreeMap::new();
            for n in names {
                nodes.insert(
                    id(n),
                    Node {
                        replica: Replica::new(id(n), Meta::default(), 0, 0, BTreeMap::new()),
                        batches: Vec::new(),
                        durable: 0,
                        auto_sync: true,
                        stores: Vec::new(),
                    },
                );
            }
            Pair {
                nodes,
                wire: VecDeque::new(),
                now: Instant::now(),
                cut_off: None,
            }
        }

        /// Carries out every output of `n`, local effects at once, messages onto the wire.
        fn drive(&mut self, n: &NodeId) {
            loop {
                let now = self.now;
                let node = self.nodes.get_mut(n).expect("node");
                let Some(out) = node.replica.poll_output() else {
                    return;
                };
                match out {
                    Output::Send { to, msg } => self.wire.push_back((n.clone(), to, msg)),
                    Output::Persist(meta) => node.replica.handle_persisted(meta.generation, now),
                    Output::Store(batches) => {
                        let first = batches[0].base;
                        node.batches.extend(batches);
                        let end = node.end();
                        node.stores.push((first, end));
                        if node.auto_sync {
                            node.durable = end;
                            node.replica.handle_durable(end, now);
                        }
                    }
                    Output::Read { to, from, fetch } => {
                        let durable = node.durable;
                        let batches = node
                            .batches
                            .iter()
                            .filter(|b| b.end() > from && b.end() <= durable)
                            .take(2)
                            .cloned()
                            .collect();
                        node.replica.handle_read(to, from, batches, fetch, now);
                    }
                    Output::AppendGenerationStart { generation } => {
                        let start = node.end();
                        node.batches
                            .push(Batch::generation_start(start, generation));
                        node.replica.handle_generation_start(start);
                        node.durable = start + 1;
                        node.replica.handle_durable(start + 1, now);
                    }
                    Output::Truncate { from } => {
                        node.batches.retain(|b| b.base < from);
                        assert!(node.end() <= from, "a cut inside a batch");
                        node.durable = node.durable.min(from);
                        node.replica.handle_truncated(now);
                    }
                    Output::ResetAt { .. } => panic!("no log here starts over"),
                    Output::KeepEpochs(_)
                    | Output::Commit(_)
                    | Output::Serving(_)
                    | Output::Halted { .. }
                    | Output::AssignmentWanted => {}
                }
            }
        }

        /// `n` loses its disk: an empty copy that keeps its ballot `(generation,
        /// leader)`, marked rebuilding since that generation (as `core/damaged.rs`
        /// leaves it).
        fn lose_copy(&mut self, n: &str, generation: u64, leader: &str) {
            let meta = Meta {
                generation,
                leader: Some(leader.into()),
                commit: 0,
                rebuilding: Some(generation),
                no_lead_through: None,
            };
            let node = self.nodes.get_mut(&id(n)).expect("node");
            node.replica = Replica::new(id(n), meta, 0, 0, BTreeMap::new());
            (node.batches, node.durable) = (Vec::new(), 0);
        }

        /// Delivers one message; false when none is on the wire.
        fn deliver_one(&mut self) -> bool {
            let Some((from, to, msg)) = self.wire.pop_front() else {
                return false;
            };
            if self
                .cut_off
                .as_ref()
                .is_some_and(|c| *c == from || *c == to)
            {
                return true;
            }
            let now = self.now;
            self.nodes
                .get_mut(&to)
                .expect("node")
                .replica
                .handle_message(from, msg, now);
            self.drive(&to);
            true
        }

        fn settle(&mut self) {
            let names: Vec<NodeId> = self.nodes.keys().cloned().collect();
            for n in &names {
                self.drive(n);
            }
            while self.deliver_one() {}
        }

        /// The leader `a` appends a batch of `records` records and makes it durable.
        fn append(&mut self, records: usize) {
            let first = self.nodes[&id("a")].end();
            let payloads = (0..records)
                .map(|i| Bytes::from(format!("r{}", first + i as u64)))
                .collect();
            assert!(self.append_records(payloads));
        }

        /// `a` appends a batch of these records and makes it durable; false (nothing
        /// appended) when it does not take writes.
        fn append_records(&mut self, records: Vec<Bytes>) -> bool {
            let now = self.now;
            let a = self.nodes.get_mut(&id("a")).expect("a");
            let first = a.end();
            let end = first + records.len() as u64;
            if !a.replica.handle_appended(first, end) {
                return false;
            }
            a.batches.push(Batch {
                base: first,
                kind: BatchKind::Data,
                timestamp_micros: 0,
                producer: None,
                records,
            });
            a.durable = end;
            a.replica.handle_durable(end, now);
            self.drive(&id("a"));
            true
        }

        /// Every node of the pair is a member of generation `generation`, led by
        /// `leader`; each is told and carries out what it asks for.
        fn assign(&mut self, generation: u64, leader: &str) {
            let all: Vec<NodeId> = self.nodes.keys().cloned().collect();
            let a = Assignment {
                generation,
                leader: id(leader),
                replicas: all.clone(),
                learners: Vec::new(),
                handoff_from: None,
            };
            for n in &all {
                let now = self.now;
                let node = self.nodes.get_mut(n).expect("node");
                node.replica.handle_assignment(a.clone(), now);
                self.drive(n);
            }
        }

        /// A heartbeat interval passes: the leader `a`'s timers run.
        fn heartbeat_time(&mut self) {
            self.now += COMMIT_HEARTBEAT;
            let now = self.now;
            let a = self.nodes.get_mut(&id("a")).expect("a");
            a.replica.handle_timeout(now);
            self.drive(&id("a"));
        }

        /// `b`'s disk finishes every store asked of it so far.
        fn sync_b(&mut self) {
            let now = self.now;
            let b = self.nodes.get_mut(&id("b")).expect("b");
            let end = b.end();
            b.durable = end;
            b.replica.handle_durable(end, now);
            self.drive(&id("b"));
        }

        fn records_on_wire(&self) -> usize {
            self.wire
                .iter()
                .filter(
                    |(_, _, m)| matches!(m, Msg::Records { batches, .. } if !batches.is_empty()),
                )
                .count()
        }
    }

    /// The record at `offset` in `n`'s durable log.
    fn value_at(n: &Node, offset: u64) -> Option<&Bytes> {
        let b = n
            .batches
            .iter()
            .find(|b| b.base <= offset && offset < b.end() && b.end() <= n.durable)?;
        b.records.get((offset - b.base) as usize)
    }

    /// An `Ok` claiming more than the leader holds (a reply meant for another shard's
    /// request, or for one of this process's previous life, its correlation id reused)
    /// counts no further than the leader's own durable end: records the leader appends
    /// afterwards still wait for the follower's real answer.
    #[test]
    fn an_ok_claiming_more_than_the_leader_holds_counts_only_what_it_holds() {
        let mut p = Pair::new();
        p.assign(1, "a");
        p.settle();
        p.nodes.get_mut(&id("b")).expect("b").auto_sync = false;
        p.append(2);
        let held = p.nodes[&id("a")].durable;
        let now = p.now;
        p.nodes
            .get_mut(&id("a"))
            .expect("a")
            .replica
            .handle_message(
                id("b"),
                Msg::Ok {
                    generation: 1,
                    end: 1_000,
                },
                now,
            );
        p.drive(&id("a"));
        // Three more records b never stored durably.
        p.wire.clear();
        p.append(3);
        p.settle();
        assert!(
            p.nodes[&id("a")].replica.commit() <= held,
            "commit {} past what the stray Ok could claim ({held})",
            p.nodes[&id("a")].replica.commit()
        );
    }

    /// `a` leads generation 1 of a, b and c and acknowledged, `Leader`-mode, three
    /// records no follower holds (its ships lost). Generation 2 hands the shard to b in
    /// a planned move, and a's fence answer is late: b and c alone are a majority.
    fn leader_tail_then_handoff_to_b(p: &mut Pair, handoff_from: Option<&str>) {
        p.assign(1, "a");
        p.settle();
        p.append(2);
        p.settle();
        p.append(3);
        p.wire.clear();
        assert_eq!(p.nodes[&id("b")].end(), 3, "start record and two");
        let a = Assignment {
            generation: 2,
            leader: id("b"),
            replicas: vec![id("a"), id("b"), id("c")],
            learners: Vec::new(),
            handoff_from: handoff_from.map(id),
        };
        p.cut_off = Some(id("a"));
        for n in ["a", "b", "c"] {
            let now = p.now;
            let node = p.nodes.get_mut(&id(n)).expect("node");
            node.replica.handle_assignment(a.clone(), now);
        }
        p.settle();
    }

    /// `after` passes and b's timers run; then every message is delivered.
    fn b_times_out_after(p: &mut Pair, after: Duration) {
        p.now += after;
        let now = p.now;
        let b = p.nodes.get_mut(&id("b")).expect("b");
        b.replica.handle_timeout(now);
        p.settle();
    }

    /// Records `n` holds, generation starts left out.
    fn data_records(p: &Pair, n: &str) -> Vec<Bytes> {
        p.nodes[&id(n)]
            .batches
            .iter()
            .filter(|b| b.kind == BatchKind::Data)
            .flat_map(|b| b.records.iter().cloned())
            .collect()
    }

    /// A planned handoff's new leader waits for the old leader's fence before it picks
    /// the log to take: the old leader is up, and its log alone holds what it
    /// acknowledged without waiting for followers. Taking the first majority's best
    /// log (b and c) lost those records while both brokers acknowledged writes.
    #[test]
    fn a_planned_handoff_takes_the_old_leaders_tail() {
        let mut p = Pair::of(&["a", "b", "c"]);
        leader_tail_then_handoff_to_b(&mut p, Some("a"));
        assert!(
            !p.nodes[&id("b")].replica.serving(),
            "b and c are a majority, but a has not answered"
        );
        // a answers the fence sent again.
        p.cut_off = None;
        b_times_out_after(&mut p, RESEND_AFTER);
        assert!(p.nodes[&id("b")].replica.serving());
        let held: Vec<Bytes> = (0..5).map(|i| Bytes::from(format!("r{}", i + 1))).collect();
        assert_eq!(
            data_records(&p, "b"),
            held,
            "a's whole log, its tail included"
        );
    }

    /// An old leader that does not answer (it died after the move was written) is
    /// waited for no longer than `HANDOFF_WAIT`: then any majority, as a failover.
    /// Without a handoff there is no wait, and its tail is lost as in a failover.
    #[test]
    fn a_planned_handoff_waits_for_the_old_leader_only_so_long() {
        let mut p = Pair::of(&["a", "b", "c"]);
        leader_tail_then_handoff_to_b(&mut p, Some("a"));
        b_times_out_after(&mut p, HANDOFF_WAIT);
        assert!(p.nodes[&id("b")].replica.serving());
        assert_eq!(data_records(&p, "b").len(), 2, "without a's tail");

        let mut p = Pair::of(&["a", "b", "c"]);
        leader_tail_then_handoff_to_b(&mut p, None);
        assert!(
            p.nodes[&id("b")].replica.serving(),
            "a failover does not wait"
        );
    }

    /// A leader told by a follower that a newer generation was accepted there stops
    /// serving at once, before its own assignments say so: the broker's acknowledgement
    /// of a Leader-mode write (which waits for no follower) checks `serving` for this,
    /// since a planned move names the successor with no lease to wait out.
    #[test]
    fn a_leader_refused_as_fenced_by_a_newer_generation_stops_serving_at_once() {
        let mut p = Pair::new();
        p.assign(1, "a");
        p.settle();
        assert!(p.nodes[&id("a")].replica.serving());
        let now = p.now;
        p.nodes
            .get_mut(&id("a"))
            .expect("a")
            .replica
            .handle_message(
                id("b"),
                Msg::Refused {
                    generation: 2,
                    code: Refusal::Fenced,
                    expected: 0,
                },
                now,
            );
        assert!(!p.nodes[&id("a")].replica.serving());
        assert_eq!(
            p.nodes[&id("a")].replica.generation(),
            1,
            "its accepted generation is unchanged: only `serving` tells"
        );
    }

    /// Why a copy that lost its log never leads the generation it lost it at. The
    /// leader `a` of generation 1 fenced everyone but shipped its records to `e` only,
    /// then lost its disk. Leading generation 1 again on the empty logs of b, c and d,
    /// it would write other records at the same offsets under the same labels, and e,
    /// comparing logs by labels, would keep its old ones and count them verified: one
    /// offset, two values. Named leader at generation 1 it stays idle and says it
    /// cannot lead; at generation 2 it fences a majority of the others and all agree.
    #[test]
    fn a_copy_that_lost_its_log_never_leads_the_generation_it_lost_it_at() {
        let all: Vec<NodeId> = ["a", "b", "c", "d", "e"].map(id).to_vec();
        let mut p = Pair::of(&["a", "b", "c", "d", "e"]);
        // One record; nothing when `a` does not take writes.
        let append = |p: &mut Pair, payload: &'static str| {
            p.append_records(vec![Bytes::from_static(payload.as_bytes())]);
        };
        // Every pair agrees wherever both hold a record.
        let agree = |p: &Pair| {
            let a = &p.nodes[&id("a")];
            for (n, node) in &p.nodes {
                for o in 0..node.durable.min(a.durable) {
                    assert_eq!(value_at(node, o), value_at(a, o), "{n} and a at {o}");
                }
            }
        };
        // Generation 1: fences reach everyone, records only e.
        p.assign(1, "a");
        let deliver_to_e_only = |p: &mut Pair| {
            while let Some((from, to, msg)) = p.wire.pop_front() {
                let shipping = matches!(msg, Msg::Records { .. } | Msg::Ok { .. });
                if shipping && from != id("e") && to != id("e") {
                    continue;
                }
                let now = p.now;
                p.nodes
                    .get_mut(&to)
                    .expect("node")
                    .replica
                    .handle_message(from, msg, now);
                p.drive(&to);
            }
        };
        deliver_to_e_only(&mut p);
        assert!(p.nodes[&id("a")].replica.serving());
        append(&mut p, "old-1");
        append(&mut p, "old-2");
        deliver_to_e_only(&mut p);
        assert_eq!(
            p.nodes[&id("e")].durable,
            3,
            "e holds the start and both records"
        );
        assert_eq!(p.nodes[&id("b")].durable, 0);
        // a loses its disk (what it had in flight too).
        p.wire.clear();
        p.lose_copy("a", 1, "a");
        // Named leader at generation 1 again (the control plane has not noticed).
        p.assign(1, "a");
        p.settle();
        append(&mut p, "new");
        p.settle();
        agree(&p);
        assert!(
            !p.nodes[&id("a")].replica.serving(),
            "it must not lead generation 1"
        );
        assert!(p.nodes[&id("a")].replica.cannot_lead());
        // Generation 2: it fences a majority of the others and leads.
        p.assign(2, "a");
        p.settle();
        assert!(p.nodes[&id("a")].replica.serving());
        assert!(
            !p.nodes[&id("a")].replica.rebuilding(),
            "whole again: it won"
        );
        append(&mut p, "new");
        p.settle();
        agree(&p);
        // (e's old records were never committed: the new leader need not keep them,
        // and e cut them where the logs differ.)
        for n in &all {
            assert_eq!(
                p.nodes[n].durable,
                p.nodes[&id("a")].durable,
                "{n} caught up"
            );
        }
    }

    /// A candidate's chosen source that loses its copy before the candidate fetched
    /// from it stops counting: the candidate fences again and takes another majority's
    /// log. (It fetched from the empty copy, was refused, and waited forever.)
    #[test]
    fn a_candidate_whose_source_lost_its_copy_takes_another_majority() {
        let all: Vec<NodeId> = ["a", "b", "c"].map(id).to_vec();
        let mut p = three_led_by_a();
        // c misses two records: a and b are ahead of it.
        p.cut_off = Some(id("c"));
        p.append(2);
        p.settle();
        p.cut_off = Some(id("a"));
        p.assign(2, "c");
        // Until c asks b, the source, for its records.
        while !p
            .wire
            .front()
            .is_some_and(|(_, to, m)| *to == id("b") && matches!(m, Msg::Fetch { .. }))
        {
            assert!(p.deliver_one(), "c fetches from b");
        }
        // b loses its copy.
        p.lose_copy("b", 2, "c");
        p.settle();
        assert!(!p.nodes[&id("c")].replica.serving(), "b no longer counts");
        // a comes back: c fences it again and takes its log.
        p.cut_off = None;
        for _ in 0..4 {
            p.now += RESEND_AFTER;
            let now = p.now;
            for n in &all {
                p.nodes
                    .get_mut(n)
                    .expect("node")
                    .replica
                    .handle_timeout(now);
                p.drive(n);
            }
            p.settle();
        }
        let c = &p.nodes[&id("c")];
        assert!(c.replica.serving(), "c leads on a's log");
        for o in 0..6 {
            assert_eq!(
                value_at(c, o),
                value_at(&p.nodes[&id("a")], o),
                "offset {o}"
            );
        }
    }

    #[test]
    fn a_staged_copy_is_shipped_to_but_counted_by_no_majority() {
        let mut p = Pair::of(&["a", "b", "c"]);
        let assign_with = |p: &mut Pair, generation: u64, learners: Vec<NodeId>| {
            let a = Assignment {
                generation,
                leader: id("a"),
                replicas: vec![id("a"), id("b")],
                learners,
                handoff_from: None,
            };
            for n in [id("a"), id("b"), id("c")] {
                let now = p.now;
                let node = p.nodes.get_mut(&n).expect("node");
                node.replica.handle_assignment(a.clone(), now);
            }
            p.settle();
        };
        let assign = |p: &mut Pair, generation: u64| assign_with(p, generation, vec![id("c")]);
        assign_with(&mut p, 1, Vec::new());
        assert!(p.nodes[&id("a")].replica.serving(), "a leads");
        p.append(5);
        p.settle();
        assert_eq!(p.nodes[&id("c")].end(), 0, "not staged yet");
        // Staged at the same generation: no election, and the copy is shipped to.
        assign(&mut p, 1);
        assert!(p.nodes[&id("a")].replica.serving(), "a still leads");
        // The staged copy holds the log (fenced when its first message was refused).
        assert_eq!(p.nodes[&id("c")].end(), p.nodes[&id("a")].end());
        assert_eq!(p.nodes[&id("c")].replica.generation(), 1);
        assert_eq!(p.nodes[&id("a")].replica.commit(), 6);
        let staged: Vec<_> = p.nodes[&id("a")]
            .replica
            .followers()
            .into_iter()
            .map(|f| (f.peer.to_string(), f.staged))
            .collect();
        assert_eq!(staged, [("b".into(), false), ("c".into(), true)]);
        // b's disk stalls: c holds the next records durably, and the mark stays.
        p.nodes.get_mut(&id("b")).expect("b").auto_sync = false;
        p.append(3);
        p.settle();
        assert_eq!(p.nodes[&id("c")].durable, 9);
        assert_eq!(
            p.nodes[&id("a")].replica.commit(),
            6,
            "c counts for nothing"
        );
        p.sync_b();
        p.settle();
        assert_eq!(p.nodes[&id("a")].replica.commit(), 9);
        // A new generation with b unreachable: c's fence does not make a majority.
        p.cut_off = Some(id("b"));
        assign(&mut p, 2);
        let resend_time = |p: &mut Pair| {
            p.now += RESEND_AFTER;
            let now = p.now;
            let a = p.nodes.get_mut(&id("a")).expect("a");
            a.replica.handle_timeout(now);
            p.settle();
        };
        for _ in 0..3 {
            resend_time(&mut p);
        }
        assert!(
            !p.nodes[&id("a")].replica.serving(),
            "no majority without b"
        );
        p.cut_off = None;
        resend_time(&mut p);
        assert!(p.nodes[&id("a")].replica.serving(), "b's fence makes it");
    }

    fn leading_pair() -> Pair {
        let mut p = Pair::new();
        let a = Assignment {
            generation: 1,
            leader: id("a"),
            replicas: vec![id("a"), id("b")],
            learners: Vec::new(),
            handoff_from: None,
        };
        for n in [id("a"), id("b")] {
            let now = p.now;
            p.nodes
                .get_mut(&n)
                .expect("node")
                .replica
                .handle_assignment(a.clone(), now);
        }
        p.settle();
        assert!(p.nodes[&id("a")].replica.serving(), "a leads");
        p
    }

    #[test]
    fn a_leader_keeps_several_messages_in_flight_and_the_follower_stores_each_on_arrival() {
        let mut p = leading_pair();
        let start = p.nodes[&id("a")].replica.commit();
        let b = p.nodes.get_mut(&id("b")).expect("b");
        b.auto_sync = false;
        b.stores.clear();
        // Ten durable batches at the leader (two per message): it sends MAX_IN_FLIGHT
        // messages and then waits, though nothing was answered yet.
        for _ in 0..10 {
            p.append(3);
        }
        assert_eq!(
            p.records_on_wire(),
            MAX_IN_FLIGHT,
            "messages in flight before any answer"
        );
        // The follower stores every one of them as it arrives: one store each, none
        // waiting for the one before to be durable.
        while p.deliver_one() {}
        let stores = p.nodes[&id("b")].stores.clone();
        assert_eq!(
            stores.len(),
            MAX_IN_FLIGHT,
            "stores asked before any is durable: {stores:?}"
        );
        assert!(
            stores.windows(2).all(|w| w[0].1 == w[1].0),
            "contiguous: {stores:?}"
        );
        assert_eq!(
            p.nodes[&id("a")].replica.commit(),
            start,
            "nothing committed yet"
        );
        // One fsync covers all four: the follower answers, the leader commits them and
        // ships the rest.
        p.sync_b();
        while p.deliver_one() {}
        let four = stores.last().expect("stores").1;
        assert!(
            p.nodes[&id("a")].replica.commit() >= four,
            "commit covers what b holds"
        );
        for _ in 0..4 {
            p.sync_b();
            while p.deliver_one() {}
        }
        let end = p.nodes[&id("a")].end();
        assert_eq!(
            p.nodes[&id("a")].replica.commit(),
            end,
            "everything committed"
        );
        // The idle leader's heartbeat brings the follower the last commit mark.
        p.heartbeat_time();
        while p.deliver_one() {}
        assert_eq!(
            p.nodes[&id("b")].replica.commit(),
            end,
            "and the follower knows it"
        );
        assert_eq!(p.nodes[&id("b")].batches, p.nodes[&id("a")].batches);
    }

    #[test]
    fn a_follower_answers_what_is_durable_before_the_rest_of_its_messages_is() {
        let mut p = leading_pair();
        p.nodes.get_mut(&id("b")).expect("b").auto_sync = false;
        for _ in 0..4 {
            p.append(2);
        }
        // Two messages arrive and are stored; the disk finishes the first one only.
        assert!(p.deliver_one());
        assert!(p.deliver_one());
        let b = p.nodes.get_mut(&id("b")).expect("b");
        let (first_end, stored) = (b.stores[b.stores.len() - 2].1, b.end());
        assert!(first_end < stored);
        let now = p.now;
        b.durable = first_end;
        b.replica.handle_durable(first_end, now);
        p.drive(&id("b"));
        let oks: Vec<u64> = p
            .wire
            .iter()
            .filter_map(|(_, to, m)| match m {
                Msg::Ok { end, .. } if **to == *"a" => Some(*end),
                _ => None,
            })
            .collect();
        assert_eq!(oks, vec![first_end], "the durable part is answered at once");
    }

    #[test]
    fn a_commit_mark_lost_on_the_network_is_sent_again_by_an_idle_leader() {
        let mut p = leading_pair();
        for _ in 0..3 {
            p.append(2);
            p.settle();
        }
        let end = p.nodes[&id("a")].end();
        assert_eq!(p.nodes[&id("a")].replica.commit(), end);
        // The heartbeat carrying the last commit mark is lost.
        p.heartbeat_time();
        assert!(p.wire.pop_front().is_some(), "a heartbeat went out");
        assert!(p.wire.is_empty());
        assert!(p.nodes[&id("b")].replica.commit() < end);
        // Unanswered, it goes out again; the follower learns the mark.
        for _ in 0..4 {
            p.heartbeat_time();
            while p.deliver_one() {}
        }
        assert_eq!(
            p.nodes[&id("b")].replica.commit(),
            end,
            "the follower knows the mark"
        );
    }

    #[test]
    fn a_replica_whose_records_are_all_below_its_base_still_reports_their_generation() {
        // Retention removed every record (base = end = 5); they were of generation 1.
        let mut r = Replica::new(id("b"), Meta::default(), 5, 5, BTreeMap::from([(0, 1)]));
        let now = Instant::now();
        r.handle_message(id("a"), Msg::Fence { generation: 2 }, now);
        r.handle_assignment(
            Assignment {
                generation: 2,
                leader: id("a"),
                replicas: vec![id("a"), id("b")],
                learners: Vec::new(),
                handoff_from: None,
            },
            now,
        );
        while let Some(out) = r.poll_output() {
            match out {
                Output::Persist(meta) => r.handle_persisted(meta.generation, now),
                Output::Send {
                    msg:
                        Msg::FenceOk {
                            last_generation,
                            end,
                            ..
                        },
                    ..
                } => {
                    assert_eq!(
                        (end, last_generation),
                        (5, 1),
                        "ends with generation 1's records"
                    );
                    return;
                }
                _ => {}
            }
        }
        panic!("no FenceOk");
    }

    #[test]
    fn durability_is_never_reported_past_what_the_replica_claimed() {
        let mut r = Replica::new(id("b"), Meta::default(), 0, 4, BTreeMap::from([(0, 1)]));
        // A store claimed [4, 10), then the log was cut at 6 (its view ends there): the
        // store's completion says 10.
        r.log.end = 10;
        r.log.cut(6);
        r.handle_durable(10, Instant::now());
        assert_eq!(r.log_end(), (6, 6), "durable up to the cut, not past it");
    }

    /// A node token proves only who its holder is: a fence at a generation no
    /// assignment names its sender leader at is not taken. Taken, its ballot (persisted)
    /// refused every real leader after it, and a bootstrap under it could erase the log.
    #[test]
    fn a_fence_from_a_node_no_assignment_names_leader_is_not_taken() {
        let mut p = three_led_by_a();
        assert!(p.nodes[&id("a")].replica.serving(), "a leads");
        let end = p.nodes[&id("a")].end();
        // Answers to the forger go nowhere.
        p.cut_off = Some(id("x"));
        {
            // A fence from a node outside the set changes nothing at the leader.
            let now = p.now;
            let a = &mut p.nodes.get_mut(&id("a")).expect("node").replica;
            a.handle_message(
                id("x"),
                Msg::Fence {
                    generation: u64::MAX,
                },
                now,
            );
            assert!(a.serving(), "a still leads after a non-member's fence");
        }
        for n in ["a", "b", "c"] {
            let now = p.now;
            let r = &mut p.nodes.get_mut(&id(n)).expect("node").replica;
            r.handle_message(
                id("x"),
                Msg::Fence {
                    generation: u64::MAX,
                },
                now,
            );
            r.handle_message(id("b"), Msg::Fence { generation: 7 }, now);
            r.handle_message(
                id("x"),
                Msg::Bootstrap {
                    generation: u64::MAX,
                    base: 1 << 40,
                },
                now,
            );
        }
        p.settle();
        // (b is a member: a fence from it at a newer generation ends a's leadership
        // until an assignment says more, as a `Fenced` refusal from it does; see
        // `a_leader_fenced_by_a_member_at_a_newer_generation_stops_leading_at_once`.)
        for n in ["a", "b", "c"] {
            assert_eq!(
                p.nodes[&id(n)].replica.generation(),
                1,
                "{n} kept its ballot"
            );
            assert_eq!(p.nodes[&id(n)].end(), end, "{n} kept its records");
        }
        // The next real leader is taken as before.
        p.assign(2, "b");
        p.settle();
        assert!(p.nodes[&id("b")].replica.serving(), "b leads generation 2");
        assert_eq!(p.nodes[&id("c")].replica.generation(), 2);
    }

    /// A planned handoff to b whose fence reaches the old leader before the control
    /// plane's feed does: the old leader stops leading at once and asks for the
    /// assignments, and answers the fence once they come. Led on until its feed said
    /// so, it acknowledged `Leader` writes and answered lease reads beside b, which
    /// takes a majority without it after `HANDOFF_WAIT`.
    #[test]
    fn a_leader_fenced_by_a_member_at_a_newer_generation_stops_leading_at_once() {
        let mut p = three_led_by_a();
        let now = p.now;
        let a = &mut p.nodes.get_mut(&id("a")).expect("node").replica;
        assert!(a.serving(), "a leads");
        let end = a.log_end().1;
        while a.poll_output().is_some() {}
        a.handle_message(id("b"), Msg::Fence { generation: 2 }, now);
        assert!(!a.serving(), "a stopped serving at the fence");
        assert!(!a.is_leader(), "a stopped leading at the fence");
        let mut asked = false;
        while let Some(out) = a.poll_output() {
            match out {
                Output::AssignmentWanted => asked = true,
                Output::Send {
                    msg: Msg::FenceOk { .. },
                    ..
                } => panic!("answered a fence no assignment names yet"),
                _ => {}
            }
        }
        assert!(asked, "a asked for the assignments");
        assert_eq!(a.generation(), 1, "no ballot taken before the assignment");
        // Should generation 2 never come (a forged fence), the control plane must still
        // learn that generation 1 has no leader.
        assert!(
            a.cannot_lead(),
            "reports that it no longer leads generation 1"
        );
        a.handle_assignment(
            Assignment {
                generation: 2,
                leader: id("b"),
                replicas: vec![id("a"), id("b"), id("c")],
                learners: Vec::new(),
                handoff_from: Some(id("a")),
            },
            now,
        );
        let answered = fence_answers(a, now)
            .into_iter()
            .find(|(to, generation, _)| *to == id("b") && *generation == 2)
            .map(|(_, _, end)| end);
        assert_eq!(
            answered,
            Some(end),
            "the fence is answered with a's whole log"
        );
        assert!(!a.serving());
        assert!(!a.cannot_lead(), "not named leader any more");
    }

    /// A leader whose last life ran under `fsync: none` and crashed may have lost
    /// records it counted durable at sequencing, which its followers hold: named leader
    /// of that generation again (the control plane had not noticed the crash), it does
    /// not carry on but reports that it cannot lead; at a newer generation it stands.
    /// Carried on, it wrote other records at offsets its followers hold acknowledged
    /// ones at, under the same label.
    #[test]
    fn a_leader_back_from_a_crash_of_an_unsynced_life_leads_only_a_newer_generation() {
        let meta = Meta {
            generation: 4,
            leader: Some("a".into()),
            commit: 10,
            rebuilding: None,
            no_lead_through: None,
        };
        let now = Instant::now();
        let assignment = |generation| Assignment {
            generation,
            leader: id("a"),
            replicas: vec![id("a"), id("b"), id("c")],
            learners: Vec::new(),
            handoff_from: None,
        };
        let fences = |r: &mut Replica| {
            let mut fences = 0;
            while let Some(out) = r.poll_output() {
                match out {
                    Output::Persist(meta) => r.handle_persisted(meta.generation, now),
                    Output::Send {
                        msg: Msg::Fence { .. },
                        ..
                    } => fences += 1,
                    _ => {}
                }
            }
            fences
        };
        // A clean life's restart carries on its own ballot.
        let mut clean = Replica::new(id("a"), meta.clone(), 0, 10, BTreeMap::from([(0, 4)]));
        clean.handle_assignment(assignment(4), now);
        assert_eq!(fences(&mut clean), 2, "a clean restart stands again");
        let meta = Meta {
            no_lead_through: Some(4),
            ..meta
        };
        // Alone in its set, it holds all there is: it stands.
        let mut alone = Replica::new(id("a"), meta.clone(), 0, 10, BTreeMap::from([(0, 4)]));
        alone.handle_assignment(
            Assignment {
                replicas: vec![id("a")],
                ..assignment(4)
            },
            now,
        );
        assert!(!alone.cannot_lead());
        let mut r = Replica::new(id("a"), meta, 0, 10, BTreeMap::from([(0, 4)]));
        r.handle_assignment(assignment(4), now);
        assert_eq!(fences(&mut r), 0, "stood again at generation 4");
        assert!(r.cannot_lead(), "says it cannot lead generation 4");
        r.handle_assignment(assignment(5), now);
        assert!(!r.cannot_lead());
        assert_eq!(fences(&mut r), 2, "stands at generation 5");
        assert_eq!(r.generation(), 5);
    }

    /// A forged fence at a generation no assignment reaches does not push out a real
    /// early one: they are kept per sender, from members only.
    #[test]
    fn a_forged_early_fence_does_not_push_out_the_real_one() {
        let mut r = Replica::new(id("b"), Meta::default(), 0, 0, BTreeMap::new());
        let now = Instant::now();
        let assignment = |generation| Assignment {
            generation,
            leader: id("a"),
            replicas: vec![id("a"), id("b"), id("c")],
            learners: Vec::new(),
            handoff_from: None,
        };
        r.handle_assignment(assignment(1), now);
        while r.poll_output().is_some() {}
        r.handle_message(id("a"), Msg::Fence { generation: 2 }, now);
        for forger in ["x", "c"] {
            r.handle_message(
                id(forger),
                Msg::Fence {
                    generation: u64::MAX,
                },
                now,
            );
        }
        assert!(r.poll_output().is_none(), "nothing before the assignment");
        r.handle_assignment(assignment(2), now);
        let answered = fence_answers(&mut r, now).iter().any(|(_, g, _)| *g == 2);
        assert!(answered, "the real early fence is answered");
        assert_eq!(r.generation(), 2);
    }

    /// A fence that reaches a replica before the assignment naming its sender (the
    /// control plane's feed reaches brokers apart) is answered when the assignment
    /// comes, not dropped for a resend.
    #[test]
    fn a_fence_ahead_of_its_assignment_is_answered_when_the_assignment_comes() {
        let mut r = Replica::new(id("b"), Meta::default(), 0, 0, BTreeMap::new());
        let now = Instant::now();
        r.handle_message(id("a"), Msg::Fence { generation: 3 }, now);
        assert!(r.poll_output().is_none(), "nothing before the assignment");
        assert_eq!(r.generation(), 0);
        r.handle_assignment(
            Assignment {
                generation: 3,
                leader: id("a"),
                replicas: vec![id("a"), id("b")],
                learners: Vec::new(),
                handoff_from: None,
            },
            now,
        );
        let answered = fence_answers(&mut r, now).iter().any(|(_, g, _)| *g == 3);
        assert!(answered, "the early fence is answered");
        assert_eq!(r.generation(), 3);
    }
}
