//! A history of client operations and a checker over the final logs.
//!
//! Workers record every operation they start: when it started and ended, and how it
//! ended — acknowledged (with its offset), refused (the broker said it did not write
//! it), or unknown (a timeout, a lost connection, an outcome-unknown error). Every
//! published payload is unique, so the checker can find each record in the final logs,
//! read back from every shard's leader after the faults heal, and report:
//!
//! - **lost**: an acknowledged record missing from the final log (on a Leader-consistency
//!   stream this is the loss its consistency allows, counted but not an error);
//! - **two values**: an offset that was acknowledged, read or finally holds more than one
//!   payload;
//! - **duplicates**: one payload at two offsets (nothing here ever resends one);
//! - **order**: a sequential producer's acknowledged records out of its order;
//! - **uncommitted reads**: a subscriber read a record that the final log does not hold
//!   at that offset (it read something that was never committed);
//! - **refused present**: a write the broker refused appears anyway.
//!
//! An acknowledgement from a deposed leader is harmful only if its record is not in the
//! successor's log; it then shows up as lost or as two values.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::{Value, json};

/// How an operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged.
    Ok,
    /// The broker said it did not apply it.
    Refused,
    /// It may or may not have been applied.
    Unknown,
}

/// What an operation was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpKind {
    /// A publish of a unique payload; `offset` when acknowledged.
    Publish {
        /// The payload.
        payload: Vec<u8>,
        /// The acknowledged offset.
        offset: Option<u64>,
    },
    /// A subscriber saw `payload` at `shard`/`offset`.
    Read {
        /// The shard.
        shard: u32,
        /// The offset.
        offset: u64,
        /// The payload.
        payload: Vec<u8>,
        /// Which of its reader's subscriptions delivered it (each subscribe a new one).
        session: u64,
    },
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    /// Which worker (producer or reader) did it.
    pub process: u32,
    /// Its sequence number within that worker.
    pub seq: u64,
    /// Whether the worker waits for each operation before the next (order is checked
    /// only then).
    pub sequential: bool,
    /// The stream.
    pub stream: String,
    /// What it was.
    pub kind: OpKind,
    /// Microseconds since the history began.
    pub start_us: u64,
    /// Microseconds since the history began.
    pub end_us: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The error text, for anything but `Ok`.
    pub error: Option<String>,
}

/// A thread-safe recorder.
#[derive(Debug)]
pub struct History {
    began: Instant,
    ops: Mutex<Vec<Op>>,
}

impl Default for History {
    fn default() -> Self {
        History {
            began: Instant::now(),
            ops: Mutex::default(),
        }
    }
}

impl History {
    /// Microseconds since the history began.
    pub fn now_us(&self) -> u64 {
        self.began.elapsed().as_micros() as u64
    }

    /// Records a finished operation.
    pub fn record(&self, op: Op) {
        self.ops.lock().expect("history lock").push(op);
    }

    /// Every operation so far, in the order they ended.
    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().expect("history lock").clone()
    }
}

/// What each stream promises about acknowledged records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promise {
    /// Nothing acknowledged may be lost (Quorum, or one durable copy).
    Durable,
    /// Acknowledged records may be lost to a failover (Leader consistency).
    LeaderOnly,
}

/// The final contents of every shard: (stream, shard) -> offset -> payload.
pub type FinalLogs = BTreeMap<(String, u32), BTreeMap<u64, Vec<u8>>>;

/// One anomaly, for the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anomaly {
    /// The stream.
    pub stream: String,
    /// The shard, where known.
    pub shard: Option<u32>,
    /// The offset, where known.
    pub offset: Option<u64>,
    /// What went wrong.
    pub what: String,
}

impl Anomaly {
    fn json(&self) -> Value {
        json!({"stream": self.stream, "shard": self.shard, "offset": self.offset, "what": self.what})
    }
}

/// What the checker found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Operations in the history.
    pub ops: usize,
    /// Acknowledged publishes.
    pub acked: usize,
    /// Refused publishes.
    pub refused: usize,
    /// Publishes with an unknown outcome.
    pub unknown: usize,
    /// Of those, how many are in the final log.
    pub unknown_present: usize,
    /// Reads checked.
    pub reads: usize,
    /// Records in the final logs.
    pub final_records: usize,
    /// Acknowledged records missing where the promise was durable.
    pub lost: Vec<Anomaly>,
    /// Acknowledged records missing where the promise allowed it.
    pub lost_allowed: usize,
    /// Offsets seen with two payloads.
    pub two_values: Vec<Anomaly>,
    /// Payloads at two offsets.
    pub duplicates: Vec<Anomaly>,
    /// Sequential producers' acknowledgements out of order.
    pub order: Vec<Anomaly>,
    /// Reads of records the final log does not hold there.
    pub uncommitted_reads: Vec<Anomaly>,
    /// Refused writes that appear.
    pub refused_present: Vec<Anomaly>,
    /// Records in a final log that no publish to that stream carried: garbage a
    /// recovery took for records, bytes a rebuilt copy made up, a record written into
    /// another stream too.
    pub invented: Vec<Anomaly>,
    /// A subscription that delivered an offset at or below one it had delivered.
    pub subscription_order: Vec<Anomaly>,
    /// A subscription that left out a record the final log holds between two it
    /// delivered.
    pub subscription_skipped: Vec<Anomaly>,
}

impl Report {
    /// Whether nothing is wrong.
    pub fn valid(&self) -> bool {
        self.lost.is_empty()
            && self.two_values.is_empty()
            && self.duplicates.is_empty()
            && self.order.is_empty()
            && self.uncommitted_reads.is_empty()
            && self.refused_present.is_empty()
            && self.invented.is_empty()
            && self.subscription_order.is_empty()
            && self.subscription_skipped.is_empty()
    }

    /// The anomaly classes found, by name.
    pub fn classes(&self) -> Vec<&'static str> {
        [
            ("lost", self.lost.len()),
            ("two_values", self.two_values.len()),
            ("duplicates", self.duplicates.len()),
            ("order", self.order.len()),
            ("uncommitted_reads", self.uncommitted_reads.len()),
            ("refused_present", self.refused_present.len()),
            ("invented", self.invented.len()),
            ("subscription_order", self.subscription_order.len()),
            ("subscription_skipped", self.subscription_skipped.len()),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(c, _)| c)
        .collect()
    }

    /// The report as JSON; each anomaly list is cut to its first 20.
    pub fn json(&self) -> Value {
        let list = |v: &[Anomaly]| json!({"count": v.len(), "first": v.iter().take(20).map(Anomaly::json).collect::<Vec<_>>()});
        json!({
            "valid": self.valid(),
            "ops": self.ops,
            "acked": self.acked,
            "refused": self.refused,
            "unknown": self.unknown,
            "unknown_present": self.unknown_present,
            "reads": self.reads,
            "final_records": self.final_records,
            "lost": list(&self.lost),
            "lost_allowed": self.lost_allowed,
            "two_values": list(&self.two_values),
            "duplicates": list(&self.duplicates),
            "order": list(&self.order),
            "uncommitted_reads": list(&self.uncommitted_reads),
            "refused_present": list(&self.refused_present),
            "invented": list(&self.invented),
            "subscription_order": list(&self.subscription_order),
            "subscription_skipped": list(&self.subscription_skipped),
        })
    }
}

/// Each subscription delivers in offset order, each offset once, and leaves out nothing
/// the final log holds between the first and the last offset it delivered. (Reads were
/// checked one by one against the final log only: a subscription that skipped a
/// record, or delivered one twice or out of order, passed.)
fn check_sessions(ops: &[Op], finals: &FinalLogs, r: &mut Report) {
    type Session<'a> = (&'a str, u32, u32, u64);
    let mut sessions: BTreeMap<Session<'_>, Vec<(u64, u64)>> = BTreeMap::new();
    for op in ops {
        if let OpKind::Read {
            shard,
            offset,
            session,
            ..
        } = &op.kind
        {
            sessions
                .entry((op.stream.as_str(), *shard, op.process, *session))
                .or_default()
                .push((op.seq, *offset));
        }
    }
    for ((stream, shard, process, session), mut got) in sessions {
        // In the order they were delivered.
        got.sort_unstable();
        let offsets: Vec<u64> = got.iter().map(|(_, o)| *o).collect();
        if let Some(w) = offsets.windows(2).find(|w| w[1] <= w[0]) {
            r.subscription_order.push(Anomaly {
                stream: stream.to_owned(),
                shard: Some(shard),
                offset: Some(w[1]),
                what: format!(
                    "reader {process}'s subscription {session} delivered offset {} after {}",
                    w[1], w[0]
                ),
            });
            continue;
        }
        let (Some(&first), Some(&last)) = (offsets.first(), offsets.last()) else {
            continue;
        };
        let delivered: BTreeSet<u64> = offsets.into_iter().collect();
        let Some(log) = finals.get(&(stream.to_owned(), shard)) else {
            continue;
        };
        let skipped: Vec<u64> = log
            .range(first..=last)
            .map(|(o, _)| *o)
            .filter(|o| !delivered.contains(o))
            .collect();
        if let Some(&at) = skipped.first() {
            r.subscription_skipped.push(Anomaly {
                stream: stream.to_owned(),
                shard: Some(shard),
                offset: Some(at),
                what: format!(
                    "reader {process}'s subscription {session} delivered {first}..={last} without {} record(s) the final log holds there",
                    skipped.len()
                ),
            });
        }
    }
}

fn show(p: &[u8]) -> String {
    String::from_utf8_lossy(p).into_owned()
}

/// How far the start of a publish may trail the leadership change that lost it (the
/// harness's poller sees a change up to this late). A Leader-stream loss is allowed when
/// a leadership change came after the publish *started*: the old leader decided the ack
/// somewhere between the publish's start and its end, possibly before the change, and
/// the ack can reach the client long after the decision (a leader frozen right after
/// deciding sends it when it is resumed, seconds later; the broker checked its lease at
/// the decision, which is all a lease can promise). A publish that started after the
/// last change and is lost was acknowledged by a deposed leader.
pub const ACK_SLACK_US: u64 = 500_000;

/// Checks `ops` against the final logs; `promise` says what each stream promises
/// (absent streams are durable); `changes` holds when the harness saw each stream's
/// leadership change (µs, the history's clock). On a Leader-consistency stream an
/// acknowledged record may be lost only to a change that came after its ack: one
/// acknowledged after every change was acknowledged by a deposed leader.
pub fn check(
    ops: &[Op],
    finals: &FinalLogs,
    promise: &HashMap<String, Promise>,
    changes: &HashMap<String, Vec<u64>>,
) -> Report {
    let mut r = Report {
        ops: ops.len(),
        final_records: finals.values().map(BTreeMap::len).sum(),
        ..Report::default()
    };
    // Where each payload finally is, and payloads at more than one place.
    let mut located: HashMap<(&str, &[u8]), (u32, u64)> = HashMap::new();
    for ((stream, shard), log) in finals {
        for (offset, payload) in log {
            if let Some((s0, o0)) = located.insert((stream, payload), (*shard, *offset)) {
                r.duplicates.push(Anomaly {
                    stream: stream.clone(),
                    shard: Some(*shard),
                    offset: Some(*offset),
                    what: format!("{:?} is also at shard {s0} offset {o0}", show(payload)),
                });
            }
        }
    }
    // Every record must be one a publish to its stream carried, whatever its outcome.
    let published: std::collections::HashSet<(&str, &[u8])> = ops
        .iter()
        .filter_map(|op| match &op.kind {
            OpKind::Publish { payload, .. } => Some((op.stream.as_str(), payload.as_slice())),
            OpKind::Read { .. } => None,
        })
        .collect();
    for ((stream, shard), log) in finals {
        for (offset, payload) in log {
            if !published.contains(&(stream.as_str(), payload.as_slice())) {
                r.invented.push(Anomaly {
                    stream: stream.clone(),
                    shard: Some(*shard),
                    offset: Some(*offset),
                    what: format!("{:?}: no publish to this stream carried it", show(payload)),
                });
            }
        }
    }
    // Every value each (stream, shard, offset) was seen with.
    let mut seen: BTreeMap<(&str, u32, u64), BTreeSet<&[u8]>> = BTreeMap::new();
    for ((stream, shard), log) in finals {
        for (offset, payload) in log {
            seen.entry((stream, *shard, *offset))
                .or_default()
                .insert(payload);
        }
    }
    // Per (process, stream, shard): (seq, offset) of acknowledged sequential publishes.
    type Acks<'a> = BTreeMap<(u32, &'a str, u32), Vec<(u64, u64)>>;
    let mut acks: Acks<'_> = BTreeMap::new();
    for op in ops {
        match &op.kind {
            OpKind::Publish { payload, offset } => {
                let at = located
                    .get(&(op.stream.as_str(), payload.as_slice()))
                    .copied();
                match op.outcome {
                    Outcome::Ok => {
                        r.acked += 1;
                        let Some((shard, final_offset)) = at else {
                            let later_change = changes
                                .get(&op.stream)
                                .is_some_and(|c| c.iter().any(|t| t + ACK_SLACK_US >= op.start_us));
                            if promise.get(&op.stream) == Some(&Promise::LeaderOnly) && later_change
                            {
                                r.lost_allowed += 1;
                            } else if promise.get(&op.stream) == Some(&Promise::LeaderOnly) {
                                r.lost.push(Anomaly {
                                    stream: op.stream.clone(),
                                    shard: None,
                                    offset: *offset,
                                    what: format!(
                                        "acknowledged {:?} at {} µs, after the last leadership change: a deposed leader acknowledged it",
                                        show(payload),
                                        op.end_us
                                    ),
                                });
                            } else {
                                r.lost.push(Anomaly {
                                    stream: op.stream.clone(),
                                    shard: None,
                                    offset: *offset,
                                    what: format!(
                                        "acknowledged {:?} (at {} µs) is not in the final log",
                                        show(payload),
                                        op.end_us
                                    ),
                                });
                            }
                            continue;
                        };
                        if let Some(o) = offset {
                            if *o != final_offset {
                                seen.entry((&op.stream, shard, *o))
                                    .or_default()
                                    .insert(payload);
                            }
                            if op.sequential {
                                acks.entry((op.process, &op.stream, shard))
                                    .or_default()
                                    .push((op.seq, *o));
                            }
                        }
                    }
                    Outcome::Refused => {
                        r.refused += 1;
                        if let Some((shard, o)) = at {
                            r.refused_present.push(Anomaly {
                                stream: op.stream.clone(),
                                shard: Some(shard),
                                offset: Some(o),
                                what: format!(
                                    "{:?} was refused ({}) but is in the log",
                                    show(payload),
                                    op.error.as_deref().unwrap_or("")
                                ),
                            });
                        }
                    }
                    Outcome::Unknown => {
                        r.unknown += 1;
                        r.unknown_present += usize::from(at.is_some());
                    }
                }
            }
            OpKind::Read {
                shard,
                offset,
                payload,
                ..
            } => {
                r.reads += 1;
                let holds = finals
                    .get(&(op.stream.clone(), *shard))
                    .and_then(|l| l.get(offset));
                if holds != Some(payload) {
                    r.uncommitted_reads.push(Anomaly {
                        stream: op.stream.clone(),
                        shard: Some(*shard),
                        offset: Some(*offset),
                        what: format!(
                            "read {:?} at {} µs; the final log holds {:?}",
                            show(payload),
                            op.end_us,
                            holds.map(|h| show(h))
                        ),
                    });
                    seen.entry((&op.stream, *shard, *offset))
                        .or_default()
                        .insert(payload);
                }
            }
        }
    }
    check_sessions(ops, finals, &mut r);
    for ((stream, shard, offset), values) in &seen {
        if values.len() > 1 {
            r.two_values.push(Anomaly {
                stream: (*stream).to_owned(),
                shard: Some(*shard),
                offset: Some(*offset),
                what: format!(
                    "seen with {}",
                    values
                        .iter()
                        .map(|v| format!("{:?}", show(v)))
                        .collect::<Vec<_>>()
                        .join(" and ")
                ),
            });
        }
    }
    for ((process, stream, shard), mut list) in acks {
        list.sort_unstable();
        for w in list.windows(2) {
            if w[1].1 <= w[0].1 {
                r.order.push(Anomaly {
                    stream: stream.to_owned(),
                    shard: Some(shard),
                    offset: Some(w[1].1),
                    what: format!(
                        "producer {process}: #{} acknowledged at {} after #{} at {}",
                        w[1].0, w[1].1, w[0].0, w[0].1
                    ),
                });
            }
        }
    }
    r
}

/// One operation on a chaos register: a key (a cache's, or an entity's state) one
/// writer sets to 1, 2, 3, ... one write at a time, and a reader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterOp {
    /// A write (else a read).
    pub write: bool,
    /// What was written, or what the read returned (0: absent).
    pub value: u64,
    /// Microseconds since the history began.
    pub start_us: u64,
    /// Microseconds since the history began.
    pub end_us: u64,
    /// How it ended (a failed read is not checked).
    pub outcome: Outcome,
}

/// The largest `value` of the entries (sorted by their time) at or before `at`.
fn max_through(sorted: &[(u64, u64)], at: u64) -> u64 {
    let n = sorted.partition_point(|&(t, _)| t <= at);
    sorted[..n].iter().map(|&(_, v)| v).max().unwrap_or(0)
}

/// Checks the register as a linearizable single-writer register. A read must return
/// at least the last write acknowledged before it began (`stale_read`) and at least
/// what a read that ended before it began returned (`non_monotonic_read`: a value seen
/// and then gone, a write read before it was committed and cut by a failover), and
/// never a value not yet written when it ended (`future_read`). The value read back
/// after the run (`final_value`, none when it could not be read: `final_unread`) must
/// be at least the last acknowledged write (`lost_write`). A write that failed may
/// have applied, and at any time after it began: the client may have sent it again
/// and given up on it while the copy was still on its way, so it could land after
/// later writes. Its value is therefore exempt from the ordering checks (a read or the
/// final value may show it below what came before).
pub fn check_register(ops: &[RegisterOp], final_value: Option<u64>) -> Value {
    let mut acked: Vec<(u64, u64)> = Vec::new();
    let mut begun: Vec<(u64, u64)> = Vec::new();
    let mut seen: Vec<(u64, u64)> = Vec::new();
    let mut maybe_late: BTreeSet<u64> = BTreeSet::new();
    for op in ops {
        match (op.write, op.outcome) {
            (true, outcome) => {
                begun.push((op.start_us, op.value));
                if outcome == Outcome::Ok {
                    acked.push((op.end_us, op.value));
                } else {
                    maybe_late.insert(op.value);
                }
            }
            (false, Outcome::Ok) => seen.push((op.end_us, op.value)),
            (false, _) => {}
        }
    }
    for v in [&mut acked, &mut begun, &mut seen] {
        v.sort_unstable();
    }
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut first: BTreeMap<&str, Value> = BTreeMap::new();
    let mut found = |class: &'static str, detail: Value| {
        *counts.entry(class).or_default() += 1;
        first.entry(class).or_insert(detail);
    };
    let reads = ops.iter().filter(|o| !o.write && o.outcome == Outcome::Ok);
    for r in reads.clone() {
        let before = r.start_us.saturating_sub(1);
        let (written, read) = (max_through(&acked, before), max_through(&seen, before));
        let latest = max_through(&begun, r.end_us);
        let detail = json!({"read": r.value, "at_us": [r.start_us, r.end_us],
            "acked_before": written, "read_before": read, "written_by_end": latest});
        let late = maybe_late.contains(&r.value);
        if r.value < written && !late {
            found("stale_read", detail.clone());
        }
        if r.value < read && !late {
            found("non_monotonic_read", detail.clone());
        }
        if r.value > latest {
            found("future_read", detail);
        }
    }
    let last_acked = acked.iter().map(|&(_, v)| v).max().unwrap_or(0);
    let last_written = begun.iter().map(|&(_, v)| v).max().unwrap_or(0);
    match final_value {
        None => found("final_unread", Value::Null),
        Some(v) if v < last_acked && !maybe_late.contains(&v) => {
            found("lost_write", json!({"final": v, "last_acked": last_acked}))
        }
        Some(v) if v > last_written => found(
            "future_read",
            json!({"final": v, "last_written": last_written}),
        ),
        Some(_) => {}
    }
    json!({
        "writes": begun.len(),
        "acked": acked.len(),
        "reads": reads.count(),
        "final": final_value,
        "last_acked": last_acked,
        "anomalies": counts.keys().collect::<Vec<_>>(),
        "counts": counts,
        "first": first,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish(process: u32, seq: u64, payload: &str, outcome: Outcome, offset: Option<u64>) -> Op {
        Op {
            process,
            seq,
            sequential: true,
            stream: "s".into(),
            kind: OpKind::Publish {
                payload: payload.as_bytes().to_vec(),
                offset,
            },
            start_us: seq * 10,
            end_us: seq * 10 + 5,
            outcome,
            error: None,
        }
    }

    fn read(offset: u64, payload: &str) -> Op {
        Op {
            process: 99,
            seq: offset,
            sequential: false,
            stream: "s".into(),
            kind: OpKind::Read {
                shard: 0,
                offset,
                payload: payload.as_bytes().to_vec(),
                session: 0,
            },
            start_us: 0,
            end_us: 0,
            outcome: Outcome::Ok,
            error: None,
        }
    }

    fn finals(records: &[&str]) -> FinalLogs {
        let log = records
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, p.as_bytes().to_vec()))
            .collect();
        BTreeMap::from([(("s".to_owned(), 0), log)])
    }

    fn run(ops: &[Op], records: &[&str]) -> Report {
        check(ops, &finals(records), &HashMap::new(), &HashMap::new())
    }

    #[test]
    fn a_clean_history_is_valid() {
        let ops = [
            publish(1, 0, "a", Outcome::Ok, Some(0)),
            publish(1, 1, "b", Outcome::Unknown, None),
            publish(1, 2, "c", Outcome::Ok, Some(2)),
            publish(1, 3, "d", Outcome::Refused, None),
            read(0, "a"),
            read(1, "b"),
            read(2, "c"),
        ];
        let r = run(&ops, &["a", "b", "c"]);
        assert!(r.valid(), "{}", r.json());
        assert_eq!(
            (r.acked, r.unknown, r.unknown_present, r.refused),
            (2, 1, 1, 1)
        );
    }

    #[test]
    fn an_acknowledged_record_missing_is_lost() {
        let r = run(&[publish(1, 0, "a", Outcome::Ok, Some(0))], &[]);
        assert_eq!(r.classes(), ["lost"]);
        // Unless the stream promised only its leader's copy and its leadership changed
        // after the publish started (at 0 µs)...
        let promise = HashMap::from([("s".to_owned(), Promise::LeaderOnly)]);
        let op = [publish(1, 0, "a", Outcome::Ok, Some(0))];
        let changed = HashMap::from([("s".to_owned(), vec![1_000])]);
        let r = check(&op, &finals(&[]), &promise, &changed);
        assert!(r.valid());
        assert_eq!(r.lost_allowed, 1);
        // ... also when the ack reached the client long after the change: the leader
        // may have decided it (under its lease) before, then been frozen before sending.
        let mut delayed = op.clone();
        delayed[0].end_us = 2_000_000;
        let r = check(&delayed, &finals(&[]), &promise, &changed);
        assert!(r.valid());
        // ... and not when the publish started after every change: a deposed leader's
        // ack.
        let mut late = op.clone();
        late[0].start_us = 1_900_000;
        late[0].end_us = 2_000_000;
        let r = check(&late, &finals(&[]), &promise, &changed);
        assert_eq!(r.classes(), ["lost"]);
    }

    #[test]
    fn an_offset_acknowledged_for_one_record_and_holding_another_has_two_values() {
        // "a" was acknowledged at 0, but the log moved it to 1 and put "x" at 0 (an
        // offset reused after a failover).
        let ops = [
            publish(1, 0, "a", Outcome::Ok, Some(0)),
            publish(2, 0, "x", Outcome::Unknown, None),
        ];
        let r = run(&ops, &["x", "a"]);
        assert_eq!(r.classes(), ["two_values"]);
    }

    #[test]
    fn a_payload_twice_is_a_duplicate() {
        let r = run(&[publish(1, 0, "a", Outcome::Ok, Some(0))], &["a", "a"]);
        assert_eq!(r.classes(), ["duplicates"]);
    }

    #[test]
    fn a_sequential_producer_acknowledged_backwards_is_out_of_order() {
        let ops = [
            publish(1, 0, "a", Outcome::Ok, Some(1)),
            publish(1, 1, "b", Outcome::Ok, Some(0)),
        ];
        let r = run(&ops, &["b", "a"]);
        assert_eq!(r.classes(), ["order"]);
    }

    #[test]
    fn reading_what_the_final_log_does_not_hold_is_an_uncommitted_read() {
        let a = publish(1, 0, "a", Outcome::Ok, Some(0));
        let r = run(&[a.clone(), read(1, "ghost")], &["a"]);
        assert_eq!(r.classes(), ["uncommitted_reads"]);
        let r = run(&[a, read(0, "ghost")], &["a"]);
        assert_eq!(r.classes(), ["two_values", "uncommitted_reads"]);
    }

    /// A subscription must deliver in offset order, each once, and leave out nothing the
    /// final log holds between its first and last delivery; another subscription of the
    /// same reader starts afresh.
    #[test]
    fn a_subscription_that_skips_repeats_or_reorders_is_caught() {
        let ops = |reads: &[(u64, u64, &str)]| -> Vec<Op> {
            let mut v: Vec<Op> = ["a", "b", "c", "d"]
                .iter()
                .enumerate()
                .map(|(i, p)| publish(1, i as u64, p, Outcome::Ok, Some(i as u64)))
                .collect();
            for (seq, (session, offset, payload)) in reads.iter().enumerate() {
                let mut r = read(*offset, payload);
                r.seq = seq as u64;
                if let OpKind::Read { session: s, .. } = &mut r.kind {
                    *s = *session;
                }
                v.push(r);
            }
            v
        };
        let log = ["a", "b", "c", "d"];
        assert!(
            run(
                &ops(&[
                    (0, 0, "a"),
                    (0, 1, "b"),
                    (1, 1, "b"),
                    (1, 3, "d"),
                    (1, 2, "c")
                ]),
                &log
            )
            .classes()
            .contains(&"subscription_order")
        );
        assert_eq!(
            run(&ops(&[(0, 0, "a"), (0, 2, "c"), (0, 3, "d")]), &log).classes(),
            ["subscription_skipped"]
        );
        assert_eq!(
            run(&ops(&[(0, 1, "b"), (0, 1, "b")]), &log).classes(),
            ["subscription_order"]
        );
        // A second subscription starting over from an earlier offset is fine.
        assert!(
            run(
                &ops(&[(0, 0, "a"), (0, 1, "b"), (1, 1, "b"), (1, 2, "c")]),
                &log
            )
            .valid()
        );
    }

    /// A record no publish to its stream carried is invented: torn bytes a recovery
    /// took for a record, a copy rebuilt with bytes nobody wrote, a record written into
    /// a second stream. Nothing else in the checker looked at records nobody asked for.
    #[test]
    fn a_record_no_publish_carried_is_invented() {
        let a = publish(1, 0, "a", Outcome::Ok, Some(0));
        let r = run(std::slice::from_ref(&a), &["a", "garbage"]);
        assert_eq!(r.classes(), ["invented"]);
        // Another stream's record counts as invented here.
        let mut other = publish(1, 1, "b", Outcome::Unknown, None);
        other.stream = "other".into();
        let r = run(&[a.clone(), other], &["a", "b"]);
        assert_eq!(r.classes(), ["invented"]);
        // Any outcome's record may be there, refused aside (reported apart).
        let unknown = publish(1, 1, "u", Outcome::Unknown, None);
        assert!(run(&[a, unknown], &["a", "u"]).valid());
    }

    fn reg(write: bool, value: u64, start_us: u64, end_us: u64, outcome: Outcome) -> RegisterOp {
        RegisterOp {
            write,
            value,
            start_us,
            end_us,
            outcome,
        }
    }

    fn register_anomalies(ops: &[RegisterOp], final_value: Option<u64>) -> Vec<String> {
        check_register(ops, final_value)["anomalies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn the_register_checker_finds_stale_lost_non_monotonic_and_future_reads() {
        let w1 = reg(true, 1, 0, 10, Outcome::Ok);
        let w2 = reg(true, 2, 20, 30, Outcome::Unknown);
        // Linearizable: a read overlapping the unknown write may see either value.
        let fine = [
            w1,
            w2,
            reg(false, 2, 25, 26, Outcome::Ok),
            reg(false, 2, 40, 41, Outcome::Ok),
        ];
        assert!(register_anomalies(&fine, Some(2)).is_empty());
        assert!(
            register_anomalies(&[w1, w2], Some(1)).is_empty(),
            "w2 may be lost"
        );
        assert_eq!(
            register_anomalies(&[w1, reg(false, 0, 11, 12, Outcome::Ok)], Some(1)),
            ["stale_read"]
        );
        assert_eq!(register_anomalies(&[w1], Some(0)), ["lost_write"]);
        assert_eq!(register_anomalies(&[w1], None), ["final_unread"]);
        assert_eq!(
            register_anomalies(&[w1, reg(false, 2, 11, 12, Outcome::Ok)], Some(1)),
            ["future_read"]
        );
        // Seen, then gone: the unknown write was read, then a failover cut it.
        let gone = [
            w1,
            w2,
            reg(false, 2, 25, 26, Outcome::Ok),
            reg(false, 1, 40, 41, Outcome::Ok),
        ];
        assert_eq!(register_anomalies(&gone, Some(1)), ["non_monotonic_read"]);
        // A failed write may land late, after later ones: its value is never out of order.
        let w3 = reg(true, 3, 50, 60, Outcome::Ok);
        let late = [
            w1,
            w2,
            w3,
            reg(false, 3, 61, 62, Outcome::Ok),
            reg(false, 2, 70, 71, Outcome::Ok),
        ];
        assert!(register_anomalies(&late, Some(2)).is_empty());
        // ... that value only: an acknowledged one read after a later one still is not.
        let stale = [w1, w2, w3, reg(false, 1, 61, 62, Outcome::Ok)];
        assert_eq!(register_anomalies(&stale, Some(3)), ["stale_read"]);
        // A failed read is not checked.
        assert!(
            register_anomalies(&[w1, reg(false, 0, 11, 12, Outcome::Unknown)], Some(1)).is_empty()
        );
    }

    #[test]
    fn a_refused_write_that_appears_is_reported() {
        let r = run(&[publish(1, 0, "a", Outcome::Refused, None)], &["a"]);
        assert_eq!(r.classes(), ["refused_present"]);
    }
}
