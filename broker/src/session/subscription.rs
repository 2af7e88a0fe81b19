//! A subscription's position and what it sends next: history read from the log, then
//! live batches, with gaps (batches dropped by a full queue) read back from the log. No
//! I/O: the driver's pump task reads the log, takes live batches from the subscriber's
//! queue and writes the frames this returns.
//!
//! What must stay true: offsets go out contiguous and increasing, each once; a batch of
//! another shard is never sent (it is counted and dropped); a generation-start record is
//! never sent, and the next event says how many offsets it skipped.

use std::sync::Arc;

use bytes::Bytes;
use felix_core_runtime::placement::ShardKey;
use felix_storage_uring::{BatchKind, ReadBatch};

use crate::shard::Envelope;
use crate::shard::{EventFormat, StreamNames, encode_events, encode_json_events};

/// One subscription's pump state.
#[derive(Debug)]
pub struct Pump {
    key: Arc<ShardKey>,
    names: StreamNames,
    format: EventFormat,
    next: u64,
    /// Offsets of generation-start records passed since the last event sent.
    skipped: u64,
    /// The client reads `skipped_before` (it offered `EVENT_BATCH_SKIPPED`): a frame
    /// with that layout to a client that did not would be misread.
    skipped_ok: bool,
    /// The client takes `subscription_lagged`: the subscription ends at its first drop
    /// instead of jumping over it.
    end_at_drop: bool,
    /// The first offset that could not be sent (the log no longer holds it).
    lagged: Option<u64>,
}

/// What to do with a live batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Live {
    /// Already sent (it overlaps history): nothing.
    Stale,
    /// Another shard's batch: never sent.
    Foreign,
    /// Records before it are missing here: read `[next, to)` from the log first, then
    /// offer the batch again.
    Gap {
        /// Where the batch starts.
        to: u64,
    },
    /// Send this frame.
    Frame(Bytes),
}

impl Pump {
    /// A pump for `key` starting at offset `start`.
    pub fn new(key: Arc<ShardKey>, start: u64, format: EventFormat) -> Pump {
        Pump {
            names: StreamNames {
                tenant: key.tenant.clone(),
                namespace: key.namespace.clone(),
                stream: key.name.clone(),
            },
            key,
            format,
            next: start,
            skipped: 0,
            skipped_ok: false,
            end_at_drop: false,
            lagged: None,
        }
    }

    /// Says in each event how many offsets before it held no record (the client
    /// negotiated `EVENT_BATCH_SKIPPED`).
    pub fn counting_skipped(mut self) -> Pump {
        self.skipped_ok = true;
        self
    }

    /// Ends the subscription at its first drop (the client negotiated
    /// `FEATURE_SUBSCRIPTION_LAGGED`): see [`Pump::lagged`].
    pub fn ending_at_drop(mut self) -> Pump {
        self.end_at_drop = true;
        self
    }

    /// Where the subscription lagged out: the first offset it could not send. Set only
    /// when it ends at drops; nothing past it is sent.
    pub fn lagged(&self) -> Option<u64> {
        self.lagged
    }

    /// The next offset to send.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// The shard.
    pub fn key(&self) -> &Arc<ShardKey> {
        &self.key
    }

    fn encode(&mut self, first: u64, records: &[Bytes]) -> Bytes {
        let skipped = std::mem::take(&mut self.skipped);
        match self.format {
            EventFormat::Binary => encode_events(
                first,
                records,
                (self.skipped_ok && skipped > 0).then_some(skipped),
            ),
            EventFormat::Json => encode_json_events(&self.names, first, records),
        }
    }

    /// Moves past offsets below `to` that the log no longer holds (retention removed
    /// them while this subscriber lagged): the client sees the jump in offsets.
    pub fn skip_to(&mut self, to: u64) {
        if to <= self.next {
            return;
        }
        if self.end_at_drop {
            self.lagged.get_or_insert(self.next);
        } else {
            self.next = to;
        }
    }

    /// Takes history read from the log at [`Pump::next`], sending records below `to`;
    /// frames go to `out`. Returns true when nothing below `to` is left to read (an
    /// empty read means the log ends here, or retention removed the rest).
    pub fn on_history(&mut self, batches: &[ReadBatch], to: u64, out: &mut Vec<Bytes>) -> bool {
        if batches.is_empty() || self.lagged.is_some() {
            return true;
        }
        for b in batches {
            if b.base_offset >= to || self.next >= to {
                return true;
            }
            if b.base_offset > self.next {
                // Records before this batch are gone (retention removed them).
                self.skip_to(b.base_offset);
                if self.lagged.is_some() {
                    return true;
                }
            }
            let end = b.base_offset + b.records.len() as u64;
            if end <= self.next {
                continue;
            }
            let skip = self.next.saturating_sub(b.base_offset) as usize;
            let keep = ((to - b.base_offset) as usize).min(b.records.len());
            let first = b.base_offset + skip as u64;
            self.next = b.base_offset + keep as u64;
            if matches!(
                b.kind,
                BatchKind::GenerationStart | BatchKind::Group | BatchKind::State
            ) {
                self.skipped += (keep - skip) as u64;
                continue;
            }
            if b.kind == BatchKind::Commit {
                // An atomic commit: readers see its event only.
                let b = crate::state::readable(b.clone());
                out.push(self.encode(first, &b.records[skip..keep]));
                continue;
            }
            let frame = self.encode(first, &b.records[skip..keep]);
            out.push(frame);
        }
        self.next >= to
    }

    /// Takes a live batch from the subscriber's queue.
    pub fn on_live(&mut self, env: &Envelope) -> Live {
        if self.lagged.is_some() {
            return Live::Stale;
        }
        if !Arc::ptr_eq(&env.key, &self.key) && *env.key != *self.key {
            return Live::Foreign;
        }
        if env.end() <= self.next {
            return Live::Stale;
        }
        if env.base_offset > self.next {
            return Live::Gap {
                to: env.base_offset,
            };
        }
        let frame = if self.skipped > 0 || env.base_offset < self.next {
            let skip = (self.next - env.base_offset) as usize;
            self.encode(self.next, &env.records[skip..])
        } else {
            env.frame(self.format)
        };
        self.next = env.end();
        Live::Frame(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_core_runtime::placement::ShardKind;
    use felix_wire::EventBatch;

    fn key(shard: u32) -> Arc<ShardKey> {
        Arc::new(ShardKey {
            kind: ShardKind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "s".into(),
            shard,
        })
    }

    fn records(n: usize) -> Vec<Bytes> {
        (0..n).map(|i| Bytes::from(format!("r{i}"))).collect()
    }

    fn batch(base: u64, n: usize, kind: BatchKind) -> ReadBatch {
        ReadBatch {
            base_offset: base,
            timestamp_micros: 0,
            kind,
            producer: None,
            records: records(n),
        }
    }

    fn env(k: &Arc<ShardKey>, base: u64, n: usize) -> Envelope {
        Envelope::new(k.clone(), base, records(n))
    }

    /// (first offset, count, skipped_before) of a binary event frame.
    fn events(frame: &Bytes) -> (u64, usize, Option<u64>) {
        let f = crate::session::testing::parse_frame(frame);
        let b = EventBatch::decode(f.flags, &f.payload).unwrap();
        (b.base_offset.unwrap().0, b.events.len(), b.skipped_before)
    }

    #[test]
    fn history_then_live_sends_every_offset_once() {
        let k = key(0);
        let mut p = Pump::new(k.clone(), 2, EventFormat::Binary);
        let mut out = Vec::new();
        // History [2, 10): the first batch starts before the subscription.
        let done = p.on_history(
            &[batch(0, 5, BatchKind::Data), batch(5, 5, BatchKind::Data)],
            10,
            &mut out,
        );
        assert!(done);
        assert_eq!(events(&out[0]), (2, 3, None));
        assert_eq!(events(&out[1]), (5, 5, None));
        // Live from 8 overlaps history: only 10.. goes out; an old batch is stale.
        assert_eq!(p.on_live(&env(&k, 5, 3)), Live::Stale);
        let Live::Frame(f) = p.on_live(&env(&k, 8, 4)) else {
            panic!()
        };
        assert_eq!(events(&f), (10, 2, None));
        assert_eq!(p.next(), 12);
    }

    /// A commit batch of several records (the wire now refuses one from a peer; this is
    /// what reached a subscriber before) sends what it holds, each at its offset: the
    /// read sliced the one event it kept by the batch's count and took the core down.
    #[test]
    fn a_commit_batch_of_several_records_reads_without_a_panic() {
        let mut p = Pump::new(key(0), 1, EventFormat::Binary);
        let mut out = Vec::new();
        assert!(p.on_history(&[batch(0, 3, BatchKind::Commit)], 3, &mut out));
        assert_eq!(events(&out[0]), (1, 2, None));
        assert_eq!(p.next(), 3);
    }

    #[test]
    fn a_dropped_batch_is_a_gap_read_back_before_the_next() {
        let k = key(0);
        let mut p = Pump::new(k.clone(), 0, EventFormat::Binary);
        let Live::Frame(_) = p.on_live(&env(&k, 0, 2)) else {
            panic!()
        };
        // [2, 5) was dropped by a full queue.
        let late = env(&k, 5, 1);
        assert_eq!(p.on_live(&late), Live::Gap { to: 5 });
        let mut out = Vec::new();
        assert!(p.on_history(
            &[batch(2, 3, BatchKind::Data), batch(5, 1, BatchKind::Data)],
            5,
            &mut out
        ));
        assert_eq!(out.len(), 1, "the read stops at the gap's end");
        assert_eq!(events(&out[0]), (2, 3, None));
        let Live::Frame(f) = p.on_live(&late) else {
            panic!()
        };
        assert_eq!(events(&f), (5, 1, None));
    }

    #[test]
    fn another_shards_batch_is_never_sent() {
        let mut p = Pump::new(key(0), 0, EventFormat::Binary);
        assert_eq!(p.on_live(&env(&key(1), 0, 3)), Live::Foreign);
        let other_tenant = Arc::new(ShardKey {
            tenant: "u".into(),
            ..(*key(0)).clone()
        });
        assert_eq!(p.on_live(&env(&other_tenant, 0, 3)), Live::Foreign);
        assert_eq!(p.next(), 0);
        assert!(
            matches!(p.on_live(&env(&key(0), 0, 1)), Live::Frame(_)),
            "an equal key in another Arc is this shard"
        );
    }

    #[test]
    fn generation_start_records_are_skipped_and_counted() {
        let k = key(0);
        let mut p = Pump::new(k.clone(), 0, EventFormat::Binary).counting_skipped();
        let mut out = Vec::new();
        p.on_history(
            &[
                batch(0, 2, BatchKind::Data),
                batch(2, 1, BatchKind::GenerationStart),
                batch(3, 2, BatchKind::Data),
            ],
            5,
            &mut out,
        );
        assert_eq!(out.len(), 2);
        assert_eq!(
            events(&out[1]),
            (3, 2, Some(1)),
            "the event after it says so"
        );
        // A generation start at the end of history is reported on the first live batch.
        p.on_history(&[batch(5, 1, BatchKind::GenerationStart)], 6, &mut out);
        let Live::Frame(f) = p.on_live(&env(&k, 6, 1)) else {
            panic!()
        };
        assert_eq!(events(&f), (6, 1, Some(1)));

        // A client that did not offer the layout gets the events without the count.
        let mut plain = Pump::new(k.clone(), 0, EventFormat::Binary);
        let mut out = Vec::new();
        plain.on_history(
            &[
                batch(0, 2, BatchKind::Data),
                batch(2, 1, BatchKind::GenerationStart),
                batch(3, 2, BatchKind::Data),
            ],
            5,
            &mut out,
        );
        assert_eq!(events(&out[1]), (3, 2, None));
    }

    #[test]
    fn an_empty_read_ends_history_early() {
        let mut p = Pump::new(key(0), 3, EventFormat::Binary);
        assert!(
            p.on_history(&[], 10, &mut Vec::new()),
            "retention removed the rest"
        );
        assert_eq!(p.next(), 3);
    }

    /// Retention removed `[3, 6)` before this subscriber read it: an old client sees the
    /// jump in offsets; one that takes `subscription_lagged` gets every record before the
    /// hole and then the offset it could not send, and nothing after.
    #[test]
    fn a_hole_is_skipped_or_ends_the_subscription_where_the_client_takes_lagged() {
        let k = key(0);
        let history = [batch(0, 3, BatchKind::Data), batch(6, 4, BatchKind::Data)];

        let mut old = Pump::new(k.clone(), 0, EventFormat::Binary);
        let mut out = Vec::new();
        assert!(old.on_history(&history, 10, &mut out));
        assert_eq!(
            out.iter().map(events).collect::<Vec<_>>(),
            vec![(0, 3, None), (6, 4, None)]
        );
        assert_eq!((old.next(), old.lagged()), (10, None));

        let mut new = Pump::new(k.clone(), 0, EventFormat::Binary).ending_at_drop();
        let mut out = Vec::new();
        assert!(new.on_history(&history, 10, &mut out));
        assert_eq!(
            out.iter().map(events).collect::<Vec<_>>(),
            vec![(0, 3, None)]
        );
        assert_eq!((new.next(), new.lagged()), (3, Some(3)));
        // Nothing more goes out, live or read back.
        assert_eq!(new.on_live(&env(&k, 10, 2)), Live::Stale);
        assert!(new.on_history(&[batch(6, 4, BatchKind::Data)], 10, &mut out));
        assert_eq!(out.len(), 1);

        // A live batch past a hole the log cannot fill (read back found nothing there).
        let mut live = Pump::new(k.clone(), 3, EventFormat::Binary).ending_at_drop();
        assert_eq!(live.on_live(&env(&k, 6, 2)), Live::Gap { to: 6 });
        live.skip_to(6);
        assert_eq!(live.lagged(), Some(3));
        let mut skipping = Pump::new(k.clone(), 3, EventFormat::Binary);
        skipping.skip_to(6);
        assert!(matches!(skipping.on_live(&env(&k, 6, 2)), Live::Frame(_)));
        assert_eq!(skipping.next(), 8);
    }
}
