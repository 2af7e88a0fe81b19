//! One consumer group's state over one stream shard, sans-IO: offsets in, decisions out,
//! time passed in as milliseconds of a clock that never steps.
//!
//! The durable part is a set of [`Event`]s (acks, dead letters, redrives, discards,
//! seeks) the caller writes to the shard's group log before it answers; recovery folds
//! the same events through [`Tracker::apply`], so the state a restart rebuilds is the
//! state that was acknowledged. Claims (who holds what until when) are memory only: a
//! restart or failover hands unsettled records out again (at-least-once).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Bounds and defaults of a group (configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a claim holds before the record is owed again.
    pub visibility_ms: u64,
    /// Deliveries before a record is dead-lettered.
    pub max_attempts: u32,
    /// Claims outstanding at once; polls at the cap answer empty.
    pub max_in_flight: usize,
    /// Claims outstanding (and records owed) in all of a shard's groups together; past
    /// it polls hand out no new record, only owed ones. Without it, 1,024 groups of
    /// 10,000 claims each let one tenant hold about 10 million claims in a shard's memory.
    pub max_in_flight_per_shard: usize,
    /// Records one poll hands out.
    pub max_claim: usize,
    /// Log bytes written after a shard's last group snapshot before its leader writes
    /// another (`mod.rs`): bounds how much of the log a new leader folds.
    pub snapshot_every_bytes: u64,
    /// A deliberate bug (the `unwritten-group-acks` mutant, debug builds with fault
    /// injection only): acks are answered without their event being written.
    pub unwritten_acks: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            visibility_ms: 30_000,
            max_attempts: 5,
            max_in_flight: 10_000,
            max_in_flight_per_shard: 1_000_000,
            max_claim: 1000,
            snapshot_every_bytes: 64 << 20,
            unwritten_acks: false,
        }
    }
}

/// A durable change to a group, written to the shard's group log before it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A record is finished.
    Ack(u64),
    /// A record was given up on: finished for the cursor, listed as a dead letter.
    Dead(u64),
    /// A dead letter is owed again, its attempts reset.
    Redrive(u64),
    /// A dead letter is dropped from the list (the record stays finished).
    Discard(u64),
    /// The cursor is placed at an offset; everything in flight or owed is forgotten.
    Seek(u64),
}

/// Why a settle was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The offset is not held by a claim of this group (never handed out, lapsed and
    /// handed out again, or settled differently).
    StaleClaim(String),
    /// An extend, or a nack naming its attempt, of a claim the consumer no longer
    /// holds: a retry cannot make it the consumer's again (the reference makes this
    /// `stale_claim` fatal).
    ClaimGone(String),
    /// The offset is not a dead letter of this group.
    NotDeadLetter(u64),
}

/// A claim on one record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Claim {
    deadline_ms: u64,
    attempts: u32,
    /// The claim pass that handed it out ([`Claimed::serial`]).
    serial: u64,
    /// The named member it was handed to, if the poll named one.
    member: Option<Arc<str>>,
}

/// A named member of a group (`consumer` on a poll, with `FEATURE_GROUP_CONSUMER`):
/// its claims are its own, and with `reclaim` a poll first hands it back the records
/// it still holds (a consumer that restarted picks up its own claims at once instead
/// of waiting out their visibility, and no other member gets them meanwhile). Names
/// are advisory, not access control: anyone the token lets read the group may poll
/// under any name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member's name (1-128 bytes).
    pub name: Arc<str>,
    /// Hand back this member's live claims first.
    pub reclaim: bool,
}

/// A record owed again (its claim lapsed, it was nacked or redriven).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owed {
    attempts: u32,
    not_before_ms: u64,
}

/// What one poll decided.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// Offsets handed out, with the delivery attempt each is on (1 = first). The first
    /// `reclaimed` of them are a member's own live claims handed back as they are: a
    /// caller that cannot deliver one leaves it claimed instead of releasing it.
    pub handed: Vec<(u64, u32)>,
    /// How many of `handed`, at its start, were reclaimed.
    pub reclaimed: usize,
    /// Offsets that reached the attempt limit: dead-lettered in memory; the caller writes
    /// an [`Event::Dead`] for each before answering (and calls [`Tracker::undo_dead`]
    /// if that write fails).
    pub dead: Vec<u64>,
    /// The walk over finished offsets stopped at [`CLAIM_PASS_MAX`]: claim again (after
    /// letting the core run something else) to go on.
    pub cut_short: bool,
    /// Names this pass's claims apart from any later claim of the same offsets, on the
    /// same attempt too (after a seek back, or the group deleted and made again): what
    /// [`Tracker::release`] hands back.
    pub serial: u64,
}

/// Finished offsets one claim passes over at most. After a fold every finished offset
/// ahead of the cursor is passed one by one on the first claims; without a bound a
/// group with millions of them would hold the core for seconds.
pub const CLAIM_PASS_MAX: usize = 65_536;

/// A group's counts, for `group_describe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Everything below is finished.
    pub committed: u64,
    /// Claims outstanding.
    pub in_flight: u64,
    /// Records owed again.
    pub owed: u64,
    /// Dead letters.
    pub dead_letters: u64,
}

/// What folding events builds of a tracker (claims are never part of it): the durable
/// state a group snapshot holds (`mod.rs`). Offsets lowest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable {
    /// The cursor.
    pub committed: u64,
    /// The next offset never handed out (as far as events tell).
    pub high_water: u64,
    /// Records owed again by a redrive.
    pub owed: Vec<u64>,
    /// Finished offsets at or past the cursor, as runs `(start, end)` (end exclusive).
    pub settled_ahead: Vec<(u64, u64)>,
    /// Dead letters.
    pub dead: Vec<u64>,
}

/// A set of offsets kept as runs, `start -> end` (end exclusive), no two touching: the
/// finished offsets ahead of a group's cursor. A record held back (claimed and extended
/// for hours) while every record after it is acked is one run here, where a set of
/// offsets held each one, without bound, and grew the group's snapshot past its limit
/// (after which every build folded the shard's whole log). Gaps between runs are records
/// not finished yet: claimed, owed, or not handed out, so there are at most as many
/// runs as claims and owed records, plus one. Offsets are below `u64::MAX` (a log's
/// never reach it): that one cannot be held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runs(BTreeMap<u64, u64>);

impl Runs {
    /// From runs in any order, overlapping or touching or not.
    pub fn from_runs(runs: impl IntoIterator<Item = (u64, u64)>) -> Runs {
        let mut r = Runs::default();
        for (start, end) in runs {
            r.insert_run(start, end);
        }
        r
    }

    /// Whether `o` is in a run.
    pub fn contains(&self, o: u64) -> bool {
        self.0
            .range(..=o)
            .next_back()
            .is_some_and(|(_, &end)| o < end)
    }

    /// Adds `o`, joining the runs it touches.
    pub fn insert(&mut self, o: u64) {
        self.insert_run(o, o.saturating_add(1));
    }

    /// Adds `start..end`, joining every run it overlaps or touches.
    fn insert_run(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        if let Some((&s, &e)) = self.0.range(..=start).next_back()
            && e >= start
        {
            start = s;
            end = end.max(e);
        }
        let joined: Vec<u64> = self.0.range(start..=end).map(|(&s, _)| s).collect();
        for s in joined {
            if let Some(e) = self.0.remove(&s) {
                end = end.max(e);
            }
        }
        self.0.insert(start, end);
    }

    /// Removes `o`, splitting its run.
    pub fn remove(&mut self, o: u64) {
        let Some((&s, &e)) = self.0.range(..=o).next_back() else {
            return;
        };
        if o >= e {
            return;
        }
        self.0.remove(&s);
        if s < o {
            self.0.insert(s, o);
        }
        if o + 1 < e {
            self.0.insert(o + 1, e);
        }
    }

    /// Takes out the run that starts at `o`: where it ended.
    pub fn take_run_at(&mut self, o: u64) -> Option<u64> {
        self.0.remove(&o)
    }

    /// Forgets every offset below `base`.
    pub fn forget_below(&mut self, base: u64) {
        let kept = self.0.split_off(&base);
        let straddling = self
            .0
            .last_key_value()
            .map(|(_, &e)| e)
            .filter(|&e| e > base);
        self.0 = kept;
        if let Some(end) = straddling {
            self.insert_run(base, end);
        }
    }

    /// Forgets every offset.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// The runs, lowest first.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(&s, &e)| (s, e))
    }
}

/// One group's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracker {
    limits: Limits,
    /// Every offset below it is finished (acked, dead-lettered or skipped), except those
    /// in `owed` (a redrive does not move the cursor back).
    committed: u64,
    /// The next offset never handed out.
    high_water: u64,
    in_flight: BTreeMap<u64, Claim>,
    owed: BTreeMap<u64, Owed>,
    /// Finished offsets at or past `committed`, waiting for the run below them.
    settled_ahead: Runs,
    dead: BTreeSet<u64>,
    /// Offsets whose ack is settled here and still being written, with the attempt the
    /// ack finished: a repeated ack of one is answered only once that write is, and a
    /// failed write owes the record again on that attempt (not durable state).
    acks_writing: BTreeMap<u64, u32>,
    /// Built from the log: the log's end then. Records below it may have been handed out
    /// by an earlier leadership (claims are not logged), and a consumer still holding
    /// one acks it: accepted though no claim here knows it, as the reference's
    /// `inherited_below` does (before 2026-12-05 refused `stale_claim` until the record
    /// was handed out again).
    inherited_below: u64,
    /// The last claim pass's [`Claimed::serial`].
    serial: Serial,
}

/// A tracker's claim-pass numbering: not part of its state, so two trackers holding
/// the same state compare equal whatever their numbering.
#[derive(Debug, Clone, Copy)]
struct Serial(u64);

impl PartialEq for Serial {
    fn eq(&self, _: &Serial) -> bool {
        true
    }
}

/// Trackers made in this process: each numbers its claim passes in a range of its own.
/// Process-wide, not per thread: a tracker moves to another core's thread with its
/// shard (a re-pin), where one made on that thread could have begun at its range (an
/// atomic add per tracker made, not per claim).
static TRACKERS_MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Where a new tracker's claim serials begin.
fn first_serial() -> u64 {
    (TRACKERS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1) << 32
}

impl Tracker {
    /// A group whose cursor starts at `start`.
    pub fn new(start: u64, limits: Limits) -> Tracker {
        Tracker {
            limits,
            committed: start,
            high_water: start,
            in_flight: BTreeMap::new(),
            owed: BTreeMap::new(),
            settled_ahead: Runs::default(),
            dead: BTreeSet::new(),
            acks_writing: BTreeMap::new(),
            inherited_below: 0,
            serial: Serial(first_serial()),
        }
    }

    /// This tracker was built from the log, whose end was `end`: acks below it are
    /// accepted without a claim (see `inherited_below`).
    pub fn inherit_below(&mut self, end: u64) {
        self.inherited_below = self.inherited_below.max(end);
    }

    /// The cursor: every offset below it is finished.
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Whether every offset from the cursor on is untouched (never handed out, owed or
    /// settled): the cursor may then move over offsets that hold no record.
    pub fn at_frontier(&self) -> bool {
        self.high_water == self.committed && self.owed.is_empty()
    }

    /// Counts for `group_describe` at `now_ms`: claims lapsed by then are owed, not in
    /// flight (counted as claims until the next poll, a crashed consumer's records
    /// showed as held).
    pub fn counts(&mut self, now_ms: u64) -> Counts {
        self.expire(now_ms);
        Counts {
            committed: self.committed,
            in_flight: self.in_flight.len() as u64,
            owed: self.owed.len() as u64,
            dead_letters: self.dead.len() as u64,
        }
    }

    /// Dead letters, lowest first.
    pub fn dead_letters(&self) -> impl Iterator<Item = u64> + '_ {
        self.dead.iter().copied()
    }

    /// Applies a durable event: during recovery, and after a live change was written.
    /// Live changes already made in memory apply again harmlessly.
    pub fn apply(&mut self, event: Event) {
        match event {
            Event::Ack(o) => {
                self.in_flight.remove(&o);
                self.owed.remove(&o);
                self.settle(o);
            }
            Event::Dead(o) => {
                self.in_flight.remove(&o);
                self.owed.remove(&o);
                self.dead.insert(o);
                self.settle(o);
            }
            Event::Redrive(o) => {
                self.dead.remove(&o);
                self.settled_ahead.remove(o);
                self.in_flight.remove(&o);
                self.owed.insert(
                    o,
                    Owed {
                        attempts: 0,
                        not_before_ms: 0,
                    },
                );
            }
            Event::Discard(o) => {
                self.dead.remove(&o);
            }
            Event::Seek(o) => {
                self.committed = o;
                self.high_water = o;
                self.in_flight.clear();
                self.owed.clear();
                self.settled_ahead.clear();
                // Dead letters at or past the new cursor are records to deliver again,
                // no longer given up on: listed, a redrive took one from the consumer
                // holding it and handed it to another.
                self.dead.retain(|&d| d < o);
                // Claims are forgotten, those of an earlier leadership too, and acks
                // being written: one that fails owes nothing in the new position.
                self.inherited_below = 0;
                self.acks_writing.clear();
            }
        }
    }

    /// Marks `o` finished and moves the cursor over the contiguous run. Does not move
    /// the high water past `o`: live, `o` was handed out and lies below it already;
    /// in a fold nothing was handed out, and the unfinished offsets between the cursor
    /// and the last settled one must go out again (they did not after a restart before:
    /// an ack past an unacked record hid that record for good).
    fn settle(&mut self, o: u64) {
        if o >= self.committed {
            self.settled_ahead.insert(o);
        }
        while let Some(end) = self.settled_ahead.take_run_at(self.committed) {
            self.committed = end;
        }
        self.high_water = self.high_water.max(self.committed);
    }

    /// Offsets below `base` are gone from the log (retention): they are finished,
    /// unread. Returns how many were skipped. Not durable: recovery skips them again.
    pub fn skip_below(&mut self, base: u64) -> u64 {
        self.forget_gone_below(base);
        while let Some((&o, _)) = self.in_flight.first_key_value()
            && o < base
        {
            self.in_flight.remove(&o);
        }
        if self.committed >= base {
            return 0;
        }
        let skipped = base - self.committed;
        self.in_flight.retain(|o, _| *o >= base);
        self.owed.retain(|o, _| *o >= base);
        self.settled_ahead.forget_below(base);
        self.committed = base;
        self.high_water = self.high_water.max(base);
        while let Some(end) = self.settled_ahead.take_run_at(self.committed) {
            self.committed = end;
        }
        skipped
    }

    /// Forgets the owed records and dead letters below `base`, gone from the log
    /// (retention). Owed ones (a redrive, a seek back) cannot be delivered, and handed
    /// out they would fail every poll that claims them until they reached the dead
    /// letters; dead letters can be neither redriven nor read, and kept they grew the
    /// group's memory and its snapshots for as long as the stream lived (past
    /// [`super::SNAPSHOT_MAX_BYTES`] no snapshot is written, and every build folds the
    /// whole log).
    pub fn forget_gone_below(&mut self, base: u64) {
        while let Some((&o, _)) = self.owed.first_key_value()
            && o < base
        {
            self.owed.remove(&o);
        }
        while let Some(&o) = self.dead.first()
            && o < base
        {
            self.dead.remove(&o);
        }
    }

    /// An offset handed out that holds no record for consumers (a replication marker):
    /// finished without a delivery. Not durable: recovery skips it again.
    pub fn skip(&mut self, o: u64) {
        self.in_flight.remove(&o);
        self.owed.remove(&o);
        self.settle(o);
    }

    /// One poll at `now_ms`: lapsed claims become owed; a reclaiming `member` first gets
    /// its own live claims back, in offset order, as they are (the same delivery, not
    /// another: attempt and deadline unchanged; `extend` renews); owed records go out before
    /// new ones, in offset order; a record past the attempt limit is dead-lettered
    /// instead; new offsets come from the cursor's run up to `tail` (exclusive). At most
    /// `max` records, and never past the in-flight cap (reclaims hold no new claim).
    /// Claims made for a named member are its own; owed records belong to no one.
    pub fn claim(
        &mut self,
        tail: u64,
        max: usize,
        now_ms: u64,
        visibility_ms: u64,
        member: Option<&Member>,
    ) -> Claimed {
        self.claim_within(tail, max, usize::MAX, now_ms, visibility_ms, member)
    }

    /// [`Tracker::claim`], handing out at most `max_new` records never handed out
    /// before (the room left under the shard's bound on claims; owed records still go).
    pub fn claim_within(
        &mut self,
        tail: u64,
        max: usize,
        max_new: usize,
        now_ms: u64,
        visibility_ms: u64,
        member: Option<&Member>,
    ) -> Claimed {
        self.expire(now_ms);
        let visibility = if visibility_ms == 0 {
            self.limits.visibility_ms
        } else {
            visibility_ms.min(self.longest_ms())
        };
        let max = max.min(self.limits.max_claim);
        self.serial.0 += 1;
        let mut out = Claimed {
            serial: self.serial.0,
            ..Claimed::default()
        };
        if let Some(m) = member.filter(|m| m.reclaim) {
            // The same claims handed back, deadlines untouched: a consumer that crashes
            // on a record and reclaims it again and again still sees it lapse at its
            // first deadline and count an attempt, so a poison record is dead-lettered
            // as without reclaim (renewing them let it escape the attempt limit: found
            // in review).
            for (o, c) in &self.in_flight {
                if out.handed.len() >= max {
                    break;
                }
                if c.member.as_deref() == Some(&*m.name) {
                    out.handed.push((*o, c.attempts));
                }
            }
            out.reclaimed = out.handed.len();
        }
        let owner = member.map(|m| m.name.clone());
        let room = |t: &Tracker, out: &Claimed| {
            out.handed.len() < max && t.in_flight.len() < t.limits.max_in_flight
        };
        // A new offset is claimed only while the records held or owed stay under the
        // cap: a nack with a delay frees a claim but owes the record, and nacking every
        // record it was handed let a consumer grow the owed map without bound (each
        // poll scanning all of it).
        let room_new = |t: &Tracker, out: &Claimed| {
            room(t, out) && t.in_flight.len() + t.owed.len() < t.limits.max_in_flight
        };
        let ready: Vec<(u64, Owed)> = self
            .owed
            .iter()
            .filter(|(_, w)| w.not_before_ms <= now_ms)
            .map(|(o, w)| (*o, *w))
            .collect();
        for (o, w) in ready {
            if !room(self, &out) {
                break;
            }
            self.owed.remove(&o);
            if w.attempts >= self.limits.max_attempts {
                self.dead.insert(o);
                self.settle(o);
                out.dead.push(o);
                continue;
            }
            self.hand(
                o,
                w.attempts + 1,
                now_ms.saturating_add(visibility),
                &owner,
                &mut out,
            );
        }
        let mut passed = 0;
        let mut new = 0;
        while self.high_water < tail && room_new(self, &out) && new < max_new {
            let o = self.high_water;
            self.high_water += 1;
            if self.settled_ahead.contains(o) || self.in_flight.contains_key(&o) {
                passed += 1;
                if passed >= CLAIM_PASS_MAX {
                    out.cut_short = true;
                    break;
                }
                continue;
            }
            if self.owed.contains_key(&o) {
                continue; // delayed: it goes out when its time comes
            }
            self.hand(o, 1, now_ms.saturating_add(visibility), &owner, &mut out);
            new += 1;
        }
        out
    }

    fn hand(
        &mut self,
        o: u64,
        attempts: u32,
        deadline_ms: u64,
        member: &Option<Arc<str>>,
        out: &mut Claimed,
    ) {
        self.in_flight.insert(
            o,
            Claim {
                deadline_ms,
                attempts,
                serial: out.serial,
                member: member.clone(),
            },
        );
        out.handed.push((o, attempts));
    }

    /// Claims whose time ran out become owed.
    fn expire(&mut self, now_ms: u64) {
        let lapsed: Vec<(u64, u32)> = self
            .in_flight
            .iter()
            .filter(|(_, c)| c.deadline_ms <= now_ms)
            .map(|(o, c)| (*o, c.attempts))
            .collect();
        for (o, attempts) in lapsed {
            self.in_flight.remove(&o);
            self.owed.insert(
                o,
                Owed {
                    attempts,
                    not_before_ms: 0,
                },
            );
        }
    }

    /// When, after `now_ms`, the next claim lapses or the next delayed record comes
    /// due, if any: a waiting poll re-checks then. Times already past are left out:
    /// records due now that a claim did not take were held back by the in-flight cap,
    /// and taking the earliest of all, one in the past hid a claim lapsing soon after.
    pub fn next_due_ms(&self, now_ms: u64) -> Option<u64> {
        let claims = self.in_flight.values().map(|c| c.deadline_ms);
        let owed = self.owed.values().map(|w| w.not_before_ms);
        claims.chain(owed).filter(|at| *at > now_ms).min()
    }

    /// Claims outstanding and records owed: what counts against the caps.
    pub fn held(&self) -> usize {
        self.in_flight.len() + self.owed.len()
    }

    /// Whether the in-flight cap holds claims back: polls find nothing to claim until
    /// an ack, nack or dead letter frees room.
    pub fn is_full(&self) -> bool {
        self.held() >= self.limits.max_in_flight
    }

    /// An ack. `Ok(Some(event))` when it must be written; `Ok(None)` for a record
    /// already finished (a repeated ack). Acks after a lapsed claim are accepted while
    /// the record has not gone out again.
    /// The caller writes the event, then calls [`Tracker::ack_written`].
    pub fn ack(&mut self, o: u64) -> Result<Option<Event>, Refusal> {
        let attempts = match self.in_flight.remove(&o) {
            Some(c) => Some(c.attempts),
            None => self.owed.remove(&o).map(|w| w.attempts),
        };
        if let Some(attempts) = attempts {
            self.apply(Event::Ack(o));
            self.acks_writing.insert(o, attempts);
            return Ok(Some(Event::Ack(o)));
        }
        if o < self.committed || self.settled_ahead.contains(o) {
            return Ok(None);
        }
        if o < self.inherited_below && !self.dead.contains(&o) {
            // Handed out, it may be, before this tracker was built: its holder's ack
            // settles it. Owed on attempt 0 again should the write fail.
            self.apply(Event::Ack(o));
            self.acks_writing.insert(o, 0);
            return Ok(Some(Event::Ack(o)));
        }
        Err(Refusal::StaleClaim(format!(
            "offset {o} is not claimed by this group"
        )))
    }

    /// The write of `o`'s ack ended: `ok`, or not (failed, or its fate unseen), and
    /// the record is owed again on the attempt the ack finished.
    /// An ack no longer known here (a seek since, or the group deleted and created
    /// again) is not undone: owed again, a record below a cursor a seek moved past went
    /// out once more.
    pub fn ack_written(&mut self, o: u64, ok: bool) {
        let Some(attempts) = self.acks_writing.remove(&o) else {
            return;
        };
        if !ok {
            self.undo_settle(o, attempts);
        }
    }

    /// Whether an ack of `o` is being written.
    pub fn is_ack_writing(&self, o: u64) -> bool {
        self.acks_writing.contains_key(&o)
    }

    /// Whether the claim on `o` is still the one a poll made: made by the claim pass
    /// `serial`, or, for a claim `member` reclaimed, that member's. A seek, a delete
    /// (and a group made again) or a lapse while the poll read its records gives the
    /// record to another claim, and the poll must not hand it out beside it.
    pub fn holds(&self, o: u64, serial: u64, member: Option<&str>) -> bool {
        self.in_flight.get(&o).is_some_and(|c| match member {
            Some(m) => c.member.as_deref() == Some(m),
            None => c.serial == serial,
        })
    }

    /// Hands a claim back that never reached the consumer: owed again, its attempt not
    /// counted. Only the claim the pass `serial` made: the poll that hands it back has
    /// awaited a read or a write since it claimed, and the claim may have lapsed and
    /// gone to another consumer meanwhile, whose claim is not this poll's to give back
    /// (matched by attempt before, a seek back let a later claim on the same attempt be
    /// taken for it).
    pub fn release(&mut self, o: u64, serial: u64) {
        if let Some(c) = self.in_flight.get(&o).filter(|c| c.serial == serial) {
            let attempts = c.attempts;
            self.in_flight.remove(&o);
            self.owed.insert(
                o,
                Owed {
                    attempts: attempts.saturating_sub(1),
                    not_before_ms: 0,
                },
            );
        }
    }

    /// Reverts a settle whose write failed: the record is owed again.
    pub fn undo_settle(&mut self, o: u64, attempts: u32) {
        self.settled_ahead.remove(o);
        if o < self.committed {
            // The cursor moved over it in memory only; owed below the cursor goes out
            // again all the same.
            self.dead.remove(&o);
        }
        self.owed.insert(
            o,
            Owed {
                attempts,
                not_before_ms: 0,
            },
        );
    }

    /// Reverts a dead-lettering whose write failed.
    pub fn undo_dead(&mut self, o: u64) {
        self.dead.remove(&o);
        self.undo_settle(o, self.limits.max_attempts);
    }

    /// A nack: the claimed record is owed again after `delay_ms`. Refused once the claim
    /// has lapsed (or the record went out again).
    /// With `attempts` (not 0) it must be the claim's: a consumer whose claim lapsed
    /// does not take the record from the one it went to next.
    pub fn nack(
        &mut self,
        o: u64,
        attempts: u32,
        now_ms: u64,
        delay_ms: u64,
    ) -> Result<(), Refusal> {
        self.expire(now_ms);
        match self.in_flight.get(&o) {
            Some(c) if attempts == 0 || c.attempts == attempts => {
                let attempts = c.attempts;
                self.in_flight.remove(&o);
                self.owed.insert(
                    o,
                    Owed {
                        attempts,
                        not_before_ms: now_ms.saturating_add(delay_ms.min(self.longest_ms())),
                    },
                );
                Ok(())
            }
            Some(c) => Err(Refusal::ClaimGone(format!(
                "offset {o} is claimed on attempt {}, not {attempts}",
                c.attempts
            ))),
            None if attempts != 0 => Err(Refusal::ClaimGone(format!(
                "offset {o} is not claimed by this group on attempt {attempts}"
            ))),
            None => Err(Refusal::StaleClaim(format!(
                "offset {o} is not claimed by this group (its claim lapsed or was settled)"
            ))),
        }
    }

    /// The longest visibility, extension or nack delay granted: ten times the
    /// group's default visibility. A client's larger value (up to `u64::MAX`) would
    /// hold a record past any consumer's crash, or wrap its deadline to the past.
    pub fn longest_ms(&self) -> u64 {
        self.limits.visibility_ms.max(1).saturating_mul(10)
    }

    /// Extends a claim on its `attempts`-th delivery by `extend_ms` from now; returns the
    /// granted visibility.
    pub fn extend(
        &mut self,
        o: u64,
        attempts: u32,
        now_ms: u64,
        extend_ms: u64,
    ) -> Result<u64, Refusal> {
        self.expire(now_ms);
        let longest = self.longest_ms();
        match self.in_flight.get_mut(&o) {
            Some(c) if c.attempts == attempts || attempts == 0 => {
                let granted = extend_ms.clamp(1, longest);
                c.deadline_ms = now_ms.saturating_add(granted);
                Ok(granted)
            }
            _ => Err(Refusal::ClaimGone(format!(
                "offset {o} is not claimed by this group on attempt {attempts}"
            ))),
        }
    }

    /// Dead-letters a claimed record at the consumer's request; the caller writes the
    /// returned event before answering. `Ok(None)` for a dead letter already: a retry
    /// whose first answer was lost (refused `stale_claim`, retryable, it was resent
    /// until its deadline and failed, though it had applied).
    pub fn dead_letter(&mut self, o: u64, now_ms: u64) -> Result<Option<Event>, Refusal> {
        self.expire(now_ms);
        if self.in_flight.remove(&o).is_some() || self.owed.remove(&o).is_some() {
            self.apply(Event::Dead(o));
            return Ok(Some(Event::Dead(o)));
        }
        if self.dead.contains(&o) {
            return Ok(None);
        }
        Err(Refusal::StaleClaim(format!(
            "offset {o} is not claimed by this group"
        )))
    }

    /// The durable state of a tracker built only by [`Tracker::apply`] (one that never
    /// claimed: such a tracker holds no claims, and the records it owes were redriven,
    /// owed at once on their first attempt).
    pub fn durable(&self) -> Durable {
        debug_assert!(
            self.in_flight.is_empty(),
            "a folded tracker holds no claims"
        );
        Durable {
            committed: self.committed,
            high_water: self.high_water,
            owed: self.owed.keys().copied().collect(),
            settled_ahead: self.settled_ahead.runs().collect(),
            dead: self.dead.iter().copied().collect(),
        }
    }

    /// The tracker that folding the events behind `d` built.
    pub fn from_durable(d: Durable, limits: Limits) -> Tracker {
        let redriven = Owed {
            attempts: 0,
            not_before_ms: 0,
        };
        Tracker {
            limits,
            committed: d.committed,
            high_water: d.high_water,
            in_flight: BTreeMap::new(),
            owed: d.owed.into_iter().map(|o| (o, redriven)).collect(),
            settled_ahead: Runs::from_runs(d.settled_ahead),
            dead: d.dead.into_iter().collect(),
            acks_writing: BTreeMap::new(),
            inherited_below: 0,
            serial: Serial(first_serial()),
        }
    }

    /// Checks that `o` is a dead letter, for redrive and discard.
    pub fn is_dead(&self, o: u64) -> Result<(), Refusal> {
        if self.dead.contains(&o) {
            Ok(())
        } else {
            Err(Refusal::NotDeadLetter(o))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs answer as the set of offsets they stand for, through any mix of inserts,
    /// removals, runs taken at the cursor and cuts below a base (seeded), and stay
    /// canonical: no two runs touch, so equal sets are equal runs.
    #[test]
    fn runs_hold_what_a_set_of_offsets_holds() {
        for seed in 1..300u64 {
            let mut x = seed;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let (mut runs, mut set) = (Runs::default(), BTreeSet::new());
            for _ in 0..200 {
                let o = next() % 48;
                match next() % 8 {
                    0..=3 => {
                        runs.insert(o);
                        set.insert(o);
                    }
                    4 | 5 => {
                        runs.remove(o);
                        set.remove(&o);
                    }
                    6 => {
                        let end = runs.take_run_at(o);
                        let mut expect = None;
                        if !set.contains(&o.wrapping_sub(1)) || o == 0 {
                            let mut e = o;
                            while set.remove(&e) {
                                e += 1;
                                expect = Some(e);
                            }
                        }
                        assert_eq!(end, expect, "seed {seed}: the run at {o}");
                    }
                    _ => {
                        let base = next() % 48;
                        runs.forget_below(base);
                        set.retain(|&v| v >= base);
                    }
                }
                for v in 0..50 {
                    assert_eq!(runs.contains(v), set.contains(&v), "seed {seed}: {v}");
                }
                let listed: Vec<(u64, u64)> = runs.runs().collect();
                assert!(
                    listed.windows(2).all(|w| w[0].1 < w[1].0),
                    "seed {seed}: runs touch: {listed:?}"
                );
                assert_eq!(Runs::from_runs(listed.iter().rev().copied()), runs);
            }
        }
    }

    /// One record held back (claimed and extended) while the 100,000 after it are
    /// acked: the finished ones ahead of the cursor are one run, and the cursor passes
    /// them all once the held one is acked. They were a set of 100,000 offsets, without
    /// bound as acks went on, which also put the group's snapshot past its limit.
    #[test]
    fn a_record_held_back_keeps_the_finished_ones_after_it_in_one_run() {
        let mut t = Tracker::new(0, limits());
        let held = t.claim(100_001, 1, 0, 1_000, None).handed;
        assert_eq!(held, vec![(0, 1)]);
        let mut next = 1;
        while next <= 100_000 {
            let claimed = t.claim(100_001, 100, 0, 1_000, None).handed;
            assert!(!claimed.is_empty());
            for (o, _) in claimed {
                assert_eq!(t.ack(o), Ok(Some(Event::Ack(o))));
                t.ack_written(o, true);
                next = next.max(o + 1);
            }
        }
        assert_eq!(t.committed(), 0);
        assert_eq!(
            t.settled_ahead.runs().collect::<Vec<_>>(),
            vec![(1, 100_001)]
        );
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
        assert_eq!(t.committed(), 100_001);
        assert_eq!(t.settled_ahead.runs().count(), 0);
    }

    /// Trackers made on different threads number their claim passes apart: a tracker
    /// moves to another core's thread with its shard, and a per-thread count began a
    /// tracker made there at the moved one's range, so a stale pass of one could match
    /// the other's claims.
    #[test]
    fn trackers_made_on_different_threads_number_their_claims_apart() {
        let here = Tracker::new(0, Limits::default()).serial.0 >> 32;
        let there = std::thread::spawn(|| Tracker::new(0, Limits::default()).serial.0 >> 32)
            .join()
            .unwrap();
        assert_ne!(here, there);
    }

    fn limits() -> Limits {
        Limits {
            visibility_ms: 1000,
            max_attempts: 3,
            max_in_flight: 100,
            max_in_flight_per_shard: 1_000_000,
            max_claim: 1000,
            snapshot_every_bytes: 1 << 20,
            unwritten_acks: false,
        }
    }

    fn offsets(c: &Claimed) -> Vec<u64> {
        c.handed.iter().map(|(o, _)| *o).collect()
    }

    #[test]
    fn a_folded_group_hands_out_again_the_unfinished_records_below_its_last_ack() {
        // What a restart folds from the log: acks of 1, 3 and 5, a dead letter at 6;
        // 0, 2 and 4 were handed out before and never finished.
        let mut t = Tracker::new(0, limits());
        for e in [Event::Ack(1), Event::Ack(3), Event::Ack(5), Event::Dead(6)] {
            t.apply(e);
        }
        assert_eq!(t.committed(), 0);
        assert_eq!(
            offsets(&t.claim(10, 10, 0, 0, None)),
            vec![0, 2, 4, 7, 8, 9]
        );
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
        assert_eq!(t.ack(2), Ok(Some(Event::Ack(2))));
        assert_eq!(t.committed(), 4);
    }

    #[test]
    fn a_claim_passes_a_bounded_number_of_finished_offsets_and_says_so() {
        let mut t = Tracker::new(0, limits());
        let ahead = 3 * CLAIM_PASS_MAX as u64;
        for o in 1..=ahead {
            t.apply(Event::Ack(o));
        }
        let first = t.claim(ahead + 10, 100, 0, 0, None);
        assert_eq!(offsets(&first), vec![0]);
        assert!(first.cut_short, "passing the acked run stops at the bound");
        let mut handed = Vec::new();
        let mut claims = 1;
        loop {
            let c = t.claim(ahead + 10, 100, 0, 0, None);
            claims += 1;
            handed.extend(offsets(&c));
            if !c.cut_short {
                break;
            }
            assert!(offsets(&c).is_empty());
        }
        assert_eq!(handed, ((ahead + 1)..(ahead + 10)).collect::<Vec<_>>());
        assert_eq!(
            claims, 4,
            "three bounded walks over the acked run, then the rest"
        );
    }

    #[test]
    fn two_polls_never_hold_the_same_record_and_the_cursor_moves_over_contiguous_acks() {
        let mut t = Tracker::new(0, limits());
        let a = t.claim(10, 4, 0, 0, None);
        let b = t.claim(10, 4, 0, 0, None);
        assert_eq!(offsets(&a), vec![0, 1, 2, 3]);
        assert_eq!(offsets(&b), vec![4, 5, 6, 7]);
        assert_eq!(t.ack(1), Ok(Some(Event::Ack(1))));
        assert_eq!(t.committed(), 0, "offset 0 is not finished");
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
        assert_eq!(t.committed(), 2);
        assert_eq!(t.ack(0), Ok(None), "a repeated ack writes nothing");
        assert!(matches!(t.ack(9), Err(Refusal::StaleClaim(_))));
    }

    #[test]
    fn a_lapsed_claim_is_owed_before_new_records_and_counts_attempts() {
        let mut t = Tracker::new(0, limits());
        t.claim(3, 1, 0, 0, None);
        // Before the visibility timeout: offset 0 stays with its holder.
        assert_eq!(t.claim(3, 1, 999, 0, None).handed, vec![(1, 1)]);
        // After it: offset 0 goes out again, on its second attempt, before offset 2.
        assert_eq!(t.claim(3, 2, 1000, 0, None).handed, vec![(0, 2), (2, 1)]);
        // The lapsed holder may still ack while no one else settled it.
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
    }

    #[test]
    fn a_nack_counts_an_attempt_and_the_limit_dead_letters() {
        let mut t = Tracker::new(0, limits());
        for attempt in 1..=3 {
            assert_eq!(t.claim(1, 1, 0, 0, None).handed, vec![(0, attempt)]);
            t.nack(0, 0, 0, 0).unwrap();
        }
        let c = t.claim(1, 1, 0, 0, None);
        assert!(c.handed.is_empty());
        assert_eq!(c.dead, vec![0]);
        assert_eq!(t.dead_letters().collect::<Vec<_>>(), vec![0]);
        assert_eq!(t.committed(), 1, "a dead letter is finished for the cursor");
        // A nack after the claim lapsed is refused.
        t.claim(2, 1, 0, 0, None);
        assert!(t.nack(1, 0, 5000, 0).is_err());
    }

    /// A consumer's dead letter resent (its first answer lost) is done, nothing written
    /// again: refused `stale_claim`, retryable, it was resent until its deadline and
    /// failed though it had applied.
    #[test]
    fn a_dead_letter_resent_is_done_already() {
        let mut t = Tracker::new(0, limits());
        t.claim(2, 1, 0, 0, None);
        assert_eq!(t.dead_letter(0, 0), Ok(Some(Event::Dead(0))));
        assert_eq!(t.dead_letter(0, 0), Ok(None));
        assert!(
            matches!(t.dead_letter(1, 0), Err(Refusal::StaleClaim(_))),
            "never handed out"
        );
    }

    #[test]
    fn redrive_owes_a_dead_letter_again_without_moving_the_cursor_back() {
        let mut t = Tracker::new(0, limits());
        t.claim(2, 2, 0, 0, None);
        assert_eq!(t.dead_letter(0, 0), Ok(Some(Event::Dead(0))));
        t.ack(1).unwrap();
        assert_eq!(t.committed(), 2);
        t.is_dead(0).unwrap();
        t.apply(Event::Redrive(0));
        assert_eq!(t.committed(), 2);
        assert_eq!(
            t.claim(2, 5, 0, 0, None).handed,
            vec![(0, 1)],
            "attempts reset"
        );
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
        assert_eq!(t.dead_letters().count(), 0);
        assert_eq!(t.is_dead(0), Err(Refusal::NotDeadLetter(0)));
    }

    #[test]
    fn a_delayed_nack_waits_and_a_poll_learns_when_to_look_again() {
        let mut t = Tracker::new(0, limits());
        t.claim(1, 1, 0, 0, None);
        t.nack(0, 0, 10, 500).unwrap();
        assert!(t.claim(1, 1, 100, 0, None).handed.is_empty());
        assert_eq!(t.next_due_ms(100), Some(510));
        // A record owed now (held back by the cap, say) does not hide a later time.
        t.owed.insert(
            7,
            Owed {
                attempts: 1,
                not_before_ms: 0,
            },
        );
        assert_eq!(t.next_due_ms(100), Some(510));
        t.owed.remove(&7);
        assert_eq!(t.claim(1, 1, 510, 0, None).handed, vec![(0, 2)]);
    }

    #[test]
    fn recovery_from_events_restores_cursor_dead_letters_and_redrives() {
        let mut live = Tracker::new(0, limits());
        let mut events = Vec::new();
        live.claim(5, 5, 0, 0, None);
        for o in [0, 1, 3] {
            events.extend(live.ack(o).unwrap());
        }
        events.extend(live.dead_letter(2, 0).unwrap());
        live.claim(5, 5, 0, 0, None);
        events.push(Event::Redrive(2));
        live.apply(Event::Redrive(2));
        let mut back = Tracker::new(0, limits());
        for e in &events {
            back.apply(*e);
        }
        assert_eq!(back.committed(), live.committed());
        assert_eq!(back.committed(), 4);
        // Offset 2 is owed again, offset 4 was never finished: both go out; 0, 1, 3 never.
        assert_eq!(offsets(&back.claim(5, 10, 0, 0, None)), vec![2, 4]);
    }

    /// Dead letters and owed records whose records retention removed are forgotten
    /// with them; those at or past the log's first offset stay.
    #[test]
    fn dead_letters_and_owed_records_below_the_logs_start_are_forgotten() {
        let mut t = Tracker::new(0, limits());
        t.claim(12, 12, 0, 0, None);
        for o in 0..12 {
            t.dead_letter(o, 0).unwrap();
        }
        t.apply(Event::Redrive(3));
        t.apply(Event::Redrive(11));
        assert_eq!(t.dead_letters().count(), 10);
        t.skip_below(10);
        assert_eq!(t.dead_letters().collect::<Vec<_>>(), vec![10]);
        assert_eq!(t.durable().owed, vec![11], "owed 3 is gone, 11 stays");
    }

    #[test]
    fn the_in_flight_cap_answers_empty_and_seek_forgets_claims() {
        let mut t = Tracker::new(
            0,
            Limits {
                max_in_flight: 2,
                ..limits()
            },
        );
        assert_eq!(t.claim(10, 5, 0, 0, None).handed.len(), 2);
        assert!(t.claim(10, 5, 0, 0, None).handed.is_empty());
        t.apply(Event::Seek(8));
        assert_eq!(offsets(&t.claim(10, 5, 0, 0, None)), vec![8, 9]);
        assert_eq!(t.skip_below(9), 1);
        assert_eq!(t.committed(), 9);
    }

    #[test]
    fn a_clients_visibility_and_nack_delay_are_bounded_and_never_wrap() {
        // limits(): default visibility 1,000 ms, so the longest grant is 10,000 ms.
        let mut t = Tracker::new(0, limits());
        assert_eq!(offsets(&t.claim(10, 1, 5, u64::MAX, None)), vec![0]);
        // The claim holds (a deadline wrapped to the past would hand 0 out again at
        // once), and lapses at the bound, not never.
        assert_eq!(offsets(&t.claim(10, 1, 6, 0, None)), vec![1]);
        assert!(!offsets(&t.claim(10, 10, 10_004, 0, None)).contains(&0));
        assert_eq!(offsets(&t.claim(10, 10, 10_005, 0, None)), vec![0]);
        // A nack's delay the same.
        t.nack(0, 0, 10_005, u64::MAX).unwrap();
        assert!(!offsets(&t.claim(10, 10, 20_004, 0, None)).contains(&0));
        assert_eq!(offsets(&t.claim(10, 10, 20_005, 0, None)), vec![0]);
        assert_eq!(t.extend(0, 0, 20_006, u64::MAX), Ok(10_000));
    }

    #[test]
    fn a_failed_ack_write_owes_the_record_on_the_attempt_it_was_on() {
        let mut t = Tracker::new(0, limits());
        assert_eq!(t.claim(10, 1, 0, 0, None).handed, vec![(0, 1)]);
        // The claim lapses; the second delivery is acked, and its write fails.
        assert_eq!(t.claim(10, 1, 1_000, 0, None).handed, vec![(0, 2)]);
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
        assert!(t.is_ack_writing(0));
        t.ack_written(0, false);
        assert!(!t.is_ack_writing(0));
        // Owed on its second attempt: the next delivery is its third (counted toward
        // the dead letters as it was), not a second again.
        assert_eq!(t.claim(10, 1, 1_001, 0, None).handed, vec![(0, 3)]);
    }

    #[test]
    fn a_nack_on_a_lapsed_attempt_leaves_the_next_holders_claim() {
        let mut t = Tracker::new(0, limits());
        assert_eq!(t.claim(10, 1, 0, 0, None).handed, vec![(0, 1)]);
        // A's claim lapses; B gets offset 0 on attempt 2.
        assert_eq!(t.claim(10, 1, 1_000, 0, None).handed, vec![(0, 2)]);
        // A nacks its attempt: refused for good (no retry makes the claim A's again),
        // B still holds it. So is an extend of it.
        assert!(matches!(t.nack(0, 1, 1_001, 0), Err(Refusal::ClaimGone(_))));
        assert!(matches!(
            t.extend(0, 1, 1_001, 10),
            Err(Refusal::ClaimGone(_))
        ));
        assert_eq!(offsets(&t.claim(10, 1, 1_002, 0, None)), vec![1]);
        // B's own nack, by attempt or without one, hands it back.
        t.nack(0, 2, 1_003, 0).unwrap();
        assert_eq!(t.claim(10, 1, 1_004, 0, None).handed, vec![(0, 3)]);
        t.nack(0, 0, 1_005, 0).unwrap();
    }

    #[test]
    fn a_rebuilt_tracker_takes_acks_of_records_an_earlier_leadership_handed_out() {
        // What a fold after a failover builds: 0 acked; 1-3 were handed out by the old
        // leader (claims are not logged) and 4 was published after; the log ended at 5.
        let mut t = Tracker::new(0, limits());
        t.apply(Event::Ack(0));
        t.inherit_below(5);
        // A consumer still holding 2 acks it: settled, written, not handed out again.
        assert_eq!(t.ack(2), Ok(Some(Event::Ack(2))));
        t.ack_written(2, true);
        assert_eq!(t.ack(2), Ok(None), "a repeated ack");
        assert_eq!(
            offsets(&t.claim(10, 10, 0, 0, None)),
            vec![1, 3, 4, 5, 6, 7, 8, 9]
        );
        // Past the end the build saw nothing was handed out before: no claim, refused.
        assert!(matches!(t.ack(12), Err(Refusal::StaleClaim(_))));
        // A failed write of such an ack owes the record again.
        let mut t = Tracker::new(0, limits());
        t.inherit_below(5);
        assert_eq!(t.ack(3), Ok(Some(Event::Ack(3))));
        t.ack_written(3, false);
        assert_eq!(t.claim(10, 1, 0, 0, None).handed, vec![(3, 1)]);
        // A fresh group's tracker (nothing inherited) refuses an unclaimed ack, and so
        // does one after a seek (claims forgotten, earlier ones too).
        let mut fresh = Tracker::new(0, limits());
        assert!(matches!(fresh.ack(2), Err(Refusal::StaleClaim(_))));
        t.apply(Event::Seek(1));
        assert!(matches!(t.ack(2), Err(Refusal::StaleClaim(_))));
    }

    #[test]
    fn an_ack_write_that_fails_after_a_seek_owes_nothing_below_the_new_cursor() {
        let mut t = Tracker::new(0, limits());
        assert_eq!(offsets(&t.claim(10, 3, 0, 0, None)), vec![0, 1, 2]);
        assert_eq!(t.ack(1), Ok(Some(Event::Ack(1))));
        // A seek past it is written and applied while the ack's write runs; then the
        // ack's write fails.
        t.apply(Event::Seek(5));
        t.ack_written(1, false);
        assert_eq!(
            offsets(&t.claim(10, 10, 0, 0, None)),
            vec![5, 6, 7, 8, 9],
            "offset 1 went out again below the cursor"
        );
    }

    #[test]
    fn a_claim_handed_back_late_leaves_the_next_holders_claim() {
        let mut t = Tracker::new(0, limits());
        // Poll A claims offset 0 on attempt 1 and, while it reads the record, the claim
        // lapses and poll B gets it on attempt 2.
        let a = t.claim(10, 1, 0, 0, None);
        assert_eq!(a.handed, vec![(0, 1)]);
        let b = t.claim(10, 1, 1_000, 0, None);
        assert_eq!(b.handed, vec![(0, 2)]);
        // A's read found the record over its answer's byte budget: it hands its claim
        // back. B's stands: a third poll gets the next record, not B's.
        t.release(0, a.serial);
        assert_eq!(t.claim(10, 1, 1_001, 0, None).handed, vec![(1, 1)]);
        // B's own hand-back owes it again, its attempt not counted.
        t.release(0, b.serial);
        assert_eq!(t.claim(10, 1, 1_002, 0, None).handed, vec![(0, 2)]);
    }

    #[test]
    fn a_claim_handed_back_late_after_a_seek_back_leaves_the_new_claim() {
        let mut t = Tracker::new(0, limits());
        // Poll A claims offset 0 on attempt 1; while it reads, the group seeks back to
        // 0 and poll B claims offset 0 on attempt 1 again.
        let a = t.claim(10, 1, 0, 60_000, None);
        assert_eq!(a.handed, vec![(0, 1)]);
        t.apply(Event::Seek(0));
        let b = t.claim(10, 1, 1, 60_000, None);
        assert_eq!(b.handed, vec![(0, 1)]);
        // A hands its claim back late: B's, on the same attempt, stands.
        t.release(0, a.serial);
        assert_eq!(
            t.claim(10, 1, 2, 60_000, None).handed,
            vec![(1, 1)],
            "offset 0 went to a second consumer while B held it"
        );
        // A group deleted and made again numbers its claims apart too.
        let mut again = Tracker::new(0, limits());
        let c = again.claim(10, 1, 3, 60_000, None);
        assert_ne!(c.serial, a.serial);
        assert_ne!(c.serial, b.serial);
    }

    #[test]
    fn a_seek_back_takes_the_dead_letters_it_delivers_again_off_the_list() {
        let mut t = Tracker::new(0, limits());
        for o in 0..2 {
            t.claim(10, 1, 0, 60_000, None);
            t.dead_letter(o, 0).unwrap();
        }
        assert_eq!(t.dead_letters().collect::<Vec<_>>(), vec![0, 1]);
        // Back to 1: record 1 goes out again; 0 stays given up on.
        t.apply(Event::Seek(1));
        assert_eq!(t.dead_letters().collect::<Vec<_>>(), vec![0]);
        assert_eq!(offsets(&t.claim(10, 1, 1, 60_000, None)), vec![1]);
        assert!(
            t.is_dead(1).is_err(),
            "a redrive would take record 1 from its holder for another consumer"
        );
    }

    /// Records nacked with a delay count against the in-flight cap until they go out
    /// again: a consumer nacking everything for later stopped claiming new records at
    /// the cap, instead of growing the owed map by the backlog.
    #[test]
    fn records_nacked_for_later_count_against_the_in_flight_cap() {
        let mut t = Tracker::new(
            0,
            Limits {
                max_in_flight: 100,
                ..limits()
            },
        );
        let mut now = 0;
        for _ in 0..20 {
            for (o, attempts) in t.claim(1_000_000, 100, now, 60_000, None).handed {
                t.nack(o, attempts, now, 10_000).unwrap();
            }
            now += 1;
        }
        let c = t.counts(now);
        assert!(c.in_flight + c.owed <= 100, "{c:?}");
        assert!(t.is_full());
        // Once due they go out again, first.
        let again = t.claim(1_000_000, 100, now + 10_000, 60_000, None);
        assert_eq!(offsets(&again), (0..100).collect::<Vec<_>>());
        assert!(again.handed.iter().all(|(_, a)| *a == 2));
    }

    #[test]
    fn a_redriven_record_that_retention_removed_is_not_handed_out() {
        let mut t = Tracker::new(0, limits());
        for o in 0..3 {
            t.apply(Event::Ack(o));
        }
        t.apply(Event::Dead(3));
        t.apply(Event::Redrive(3));
        t.apply(Event::Ack(4));
        assert_eq!(t.committed(), 5, "3 is owed again below nothing unsettled");
        // Retention removed offsets below 4 meanwhile.
        t.skip_below(4);
        assert_eq!(offsets(&t.claim(10, 5, 0, 0, None)), vec![5, 6, 7, 8, 9]);
    }

    fn member(name: &str, reclaim: bool) -> Member {
        Member {
            name: name.into(),
            reclaim,
        }
    }

    #[test]
    fn a_reclaiming_member_gets_its_own_live_claims_back_first_and_nobody_elses() {
        let mut t = Tracker::new(0, limits());
        let (a, b) = (member("a", false), member("b", false));
        // a holds 0-2, b holds 3-4, until 1,000 ms.
        assert_eq!(offsets(&t.claim(20, 3, 0, 1000, Some(&a))), vec![0, 1, 2]);
        assert_eq!(offsets(&t.claim(20, 2, 0, 1000, Some(&b))), vec![3, 4]);
        // Without reclaim a named poll gets new records, not its own claims (5, until
        // 1,100 ms).
        assert_eq!(offsets(&t.claim(20, 1, 100, 1000, Some(&a))), vec![5]);
        // a restarts and reclaims at 500 ms: its four come back first, on the same
        // attempt, then new ones (until 1,500 ms); b's are not touched.
        let c = t.claim(20, 6, 500, 1000, Some(&member("a", true)));
        assert_eq!(c.reclaimed, 4);
        assert_eq!(
            c.handed,
            vec![(0, 1), (1, 1), (2, 1), (5, 1), (6, 1), (7, 1)]
        );
        // A reclaim is bounded by the poll's max; a member holding nothing gets none.
        let some = t.claim(20, 2, 600, 1000, Some(&member("a", true)));
        assert_eq!((some.reclaimed, offsets(&some)), (2, vec![0, 1]));
        assert_eq!(
            t.claim(20, 1, 600, 1000, Some(&member("z", true)))
                .reclaimed,
            0
        );
        // A reclaim renews nothing: at 1,050 ms 0-2 (reclaimed twice) have lapsed like
        // b's 3-4, and go out again to anyone on attempt 2; a reclaim then gets only
        // a's claims still live (5, 6, 7).
        let later = t.claim(20, 20, 1050, 1000, Some(&member("a", true)));
        assert_eq!(later.reclaimed, 3);
        assert_eq!(later.handed[..3], [(5, 1), (6, 1), (7, 1)]);
        assert_eq!(
            later.handed[3..8],
            [(0, 2), (1, 2), (2, 2), (3, 2), (4, 2)],
            "lapsed claims are owed to anyone, on their next attempt"
        );
    }

    #[test]
    fn reclaiming_does_not_keep_a_poison_record_from_the_dead_letters() {
        // A consumer that crashes on record 0 and reclaims it on every restart: each
        // lapse counts an attempt, and at the limit (3 here) it is dead-lettered.
        let mut t = Tracker::new(
            0,
            Limits {
                max_attempts: 3,
                ..limits()
            },
        );
        let crashing = member("a", true);
        let mut now = 0;
        let mut dead = false;
        for _ in 0..20 {
            let c = t.claim(1, 1, now, 100, Some(&crashing));
            dead |= c.dead.contains(&0);
            now += 60; // restarts within the visibility, and reclaims
        }
        assert!(dead, "the poison record reached the dead letters");
        assert_eq!(t.dead_letters().collect::<Vec<_>>(), vec![0]);
    }

    #[test]
    fn a_reclaimed_claim_is_acked_like_any_other() {
        let mut t = Tracker::new(0, limits());
        t.claim(5, 2, 0, 1000, Some(&member("a", false)));
        let back = t.claim(5, 2, 10, 1000, Some(&member("a", true)));
        assert_eq!((back.reclaimed, offsets(&back)), (2, vec![0, 1]));
        assert_eq!(t.ack(0), Ok(Some(Event::Ack(0))));
        assert_eq!(t.ack(1), Ok(Some(Event::Ack(1))));
        assert_eq!(t.committed(), 2);
        assert_eq!(t.counts(10).in_flight, 0);
    }

    /// A describe counts lapsed claims as owed, not held.
    #[test]
    fn counts_take_lapsed_claims_as_owed() {
        let mut t = Tracker::new(0, limits());
        t.claim(5, 2, 0, 1000, None);
        let c = t.counts(999);
        assert_eq!((c.in_flight, c.owed), (2, 0));
        let c = t.counts(1000);
        assert_eq!((c.in_flight, c.owed), (0, 2));
    }
}
