//! Shards owned by a core: a stream shard (its log and its fanout frontier) and a cache
//! shard (its log and the key index derived from it). Only the owning core touches
//! them.

mod recent;
pub mod snapshots;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::task::{Poll, Waker};

use bytes::{BufMut, Bytes, BytesMut};
use felix_core_runtime::CoreId;
use felix_core_runtime::clock::Now;
use felix_core_runtime::placement::ShardKey;
use felix_storage_uring::{Appended, BatchKind, DmaBackend, ReadBatch, SegmentLog};
use felix_wire::{EventBatch, EventItem, Flags, Message, Offset};

use crate::error::BrokerError;
pub use recent::RECENT_IDLE;
pub use recent::Wake;
use recent::{Recent, Waiting, Woken, is_change};

/// The names a JSON event carries.
#[derive(Debug)]
pub struct StreamNames {
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
}

impl StreamNames {
    /// The names of `key`'s stream.
    pub fn of(key: &ShardKey) -> StreamNames {
        StreamNames {
            tenant: key.tenant.clone(),
            namespace: key.namespace.clone(),
            stream: key.name.clone(),
        }
    }
}

/// How a subscriber wants events framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventFormat {
    /// Shared binary batch with base offset (flags 0x0024).
    Binary,
    /// JSON `event_batch` with `base_offset` (clients without the binary layouts).
    Json,
}

impl EventFormat {
    /// The format for a client's negotiated flags.
    pub fn for_flags(peer: Flags) -> EventFormat {
        if peer.contains(Flags::BINARY_EVENT_BATCH_SHARED.union(Flags::EVENT_BATCH_OFFSETS)) {
            EventFormat::Binary
        } else {
            EventFormat::Json
        }
    }
}

/// One committed batch, shared by every subscriber on every core. Each wire format is
/// encoded at most once, by whichever subscriber needs it first.
#[derive(Debug)]
pub struct Envelope {
    /// The shard it was committed to: a subscriber checks it before sending.
    pub key: Arc<ShardKey>,
    /// Offset of `records[0]`.
    pub base_offset: u64,
    /// The records.
    pub records: Vec<Bytes>,
    /// Their bytes.
    bytes: usize,
    binary: OnceLock<Bytes>,
    json: OnceLock<Bytes>,
}

impl Envelope {
    /// A new envelope.
    pub fn new(key: Arc<ShardKey>, base_offset: u64, records: Vec<Bytes>) -> Envelope {
        Envelope {
            key,
            base_offset,
            bytes: records.iter().map(Bytes::len).sum(),
            records,
            binary: OnceLock::new(),
            json: OnceLock::new(),
        }
    }

    /// Bytes of its records.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn names(&self) -> StreamNames {
        StreamNames::of(&self.key)
    }

    /// One past the last record.
    pub fn end(&self) -> u64 {
        self.base_offset + self.records.len() as u64
    }

    /// The whole-batch frame in `format`, encoded once.
    pub fn frame(&self, format: EventFormat) -> Bytes {
        match format {
            EventFormat::Binary => self
                .binary
                .get_or_init(|| encode_events(self.base_offset, &self.records, None))
                .clone(),
            EventFormat::Json => self
                .json
                .get_or_init(|| encode_json_events(&self.names(), self.base_offset, &self.records))
                .clone(),
        }
    }

    /// A frame for the records from `from` on (after a partial history read).
    pub fn frame_from(&self, from: u64, format: EventFormat) -> Bytes {
        if from <= self.base_offset {
            return self.frame(format);
        }
        let skip = (from - self.base_offset) as usize;
        let rest = &self.records[skip.min(self.records.len())..];
        match format {
            EventFormat::Binary => encode_events(from, rest, None),
            EventFormat::Json => encode_json_events(&self.names(), from, rest),
        }
    }
}

/// The most payload an event frame carries: a client's frame limit (16 MiB by default;
/// the broker's own `max_frame_bytes` may take larger publishes).
const EVENT_FRAME_MAX: usize = felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize;

/// Splits `records` into runs whose frames stay within [`EVENT_FRAME_MAX`], given each
/// record's `cost` in a frame and a frame's `fixed` cost: `(start, end)` of each run. A
/// record too large for any frame goes alone (its frame is refused by the reader; see
/// docs/state.md, reads).
fn runs(records: &[Bytes], fixed: usize, cost: impl Fn(usize) -> usize) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let (mut start, mut size) = (0, fixed);
    for (i, r) in records.iter().enumerate() {
        let c = cost(r.len());
        if i > start && size + c > EVENT_FRAME_MAX {
            runs.push((start, i));
            (start, size) = (i, fixed);
        }
        size += c;
    }
    runs.push((start, records.len()));
    runs
}

/// Encodes records as shared binary event batches: one frame, or, when that would be
/// larger than a client reads, several back to back (a batch a publish of nearly a
/// frame's size wrote came out a few bytes over with `skipped_before`, and one the
/// broker's larger `max_frame_bytes` took, far over). `skipped_before` goes with the
/// first.
pub fn encode_events(base_offset: u64, records: &[Bytes], skipped_before: Option<u64>) -> Bytes {
    let one = |first: usize, records: &[Bytes], skipped_before: Option<u64>| {
        let batch = EventBatch {
            subscription_id: None,
            base_offset: Some(Offset(base_offset + first as u64)),
            skipped_before,
            publisher: None,
            timestamps: false,
            events: records
                .iter()
                .map(|r| EventItem {
                    timestamp_micros: None,
                    payload: r.clone(),
                })
                .collect(),
        };
        let mut buf = BytesMut::new();
        batch
            .encode_frame(&mut buf)
            .expect("a committed batch fits an event frame");
        buf.freeze()
    };
    let body: usize = records.iter().map(|r| 4 + r.len()).sum();
    if 24 + body <= EVENT_FRAME_MAX {
        return one(0, records, skipped_before);
    }
    let mut out = BytesMut::new();
    for (i, (start, end)) in runs(records, 24, |n| 4 + n).into_iter().enumerate() {
        let skipped = if i == 0 { skipped_before } else { None };
        out.extend_from_slice(&one(start, &records[start..end], skipped));
    }
    out.freeze()
}

/// Encodes records as JSON `event_batch`es: one, or several back to back when one would
/// be larger than a client reads (base64 takes a third more: a binary publish of more
/// than about 12 MiB was sent to JSON subscribers as one frame over 16 MiB, refused by
/// their readers at every retry).
pub fn encode_json_events(names: &StreamNames, base_offset: u64, records: &[Bytes]) -> Bytes {
    let one = |first: usize, records: &[Bytes]| {
        Message::EventBatch {
            tenant_id: names.tenant.clone(),
            namespace: names.namespace.clone(),
            stream: names.stream.clone(),
            payloads: records.to_vec(),
            base_offset: Some(Offset(base_offset + first as u64)),
        }
        .to_frame()
    };
    // Quotes and a comma around each record's base64; the type, names, offset and
    // brackets once (names are plain: letters, digits, `-`, `_`, `.`).
    let cost = |n: usize| n.div_ceil(3) * 4 + 3;
    let fixed = 256 + names.tenant.len() + names.namespace.len() + names.stream.len();
    let body: usize = records.iter().map(|r| cost(r.len())).sum();
    if fixed + body <= EVENT_FRAME_MAX {
        return one(0, records);
    }
    let mut out = BytesMut::new();
    for (start, end) in runs(records, fixed, cost) {
        out.extend_from_slice(&one(start, &records[start..end]));
    }
    out.freeze()
}

/// A stream shard on its owning core.
pub struct StreamShard {
    /// Which shard.
    pub key: Arc<ShardKey>,
    /// Its log.
    pub log: SegmentLog<DmaBackend>,
    /// Next offset to fan out: everything below it has been handed to subscribers.
    fanout_end: Cell<u64>,
    /// Cores with subscribers to this shard, and how many.
    interested: RefCell<HashMap<CoreId, usize>>,
    /// Woken when the fanout frontier moves: waiting group polls look again.
    pub appended: crate::groups::Wakers,
    /// The shard's state (atomic commits), built on demand.
    pub state: RefCell<Option<crate::state::StateIndex>>,
    /// Idempotent producers: built from the log on first use, then kept current by
    /// every claim on this core (`None` until built, or after a reset).
    pub producers: RefCell<Option<crate::producers::ProducerTable>>,
    /// Idempotent publishes waiting, in arrival order, while the table is built.
    pub idempotent_queue: RefCell<crate::producers::Waiting>,
    /// Whether a task is building the producer table.
    pub building_producers: std::cell::Cell<bool>,
    /// The first offset claimed while the shard had no producer table: every claim
    /// from there on holds no producer's batch (an idempotent publish waits for a
    /// table), so a build that has read up to it covers the rest without reading it.
    /// (Reading it, a build chased the end of a log taking other writes, for good.)
    pub untagged_from: Cell<Option<u64>>,
    /// Moved by every [`StreamShard::reset_fanout`]: a producer table built across one
    /// read a log since cut, and is built again.
    pub producers_epoch: Cell<u64>,
    /// The log's size when its producer table was last saved as a snapshot (or what the
    /// build of the table left unread).
    pub producers_snapshot_mark: Cell<u64>,
    /// A follower stored a batch of an idempotent producer here this life: its table is
    /// saved now and then though this core keeps none (a failover reads little).
    pub producer_batches_stored: Cell<bool>,
    /// Whether a task is reading the table to save it (a follower's copy).
    pub saving_producers: Cell<bool>,
    /// The shard's consumer groups while this core leads it (built on first use).
    pub groups: RefCell<Option<std::rc::Rc<crate::groups::GroupShard>>>,
    /// Whether a task is building the groups.
    pub building_groups: std::cell::Cell<bool>,
    /// The groups' state as another core handed it over in a live re-pin whose open of
    /// this log here failed for want of resources, until the groups are built from it
    /// (not from the log: its claims in flight are only here).
    pub handed_groups: RefCell<Option<crate::groups::GroupState>>,
    /// Whether this log may hold a `Group` batch: one was there when the shard opened
    /// (its segments say), or passed through this core since (stored from a leader, or
    /// written or folded here). Its groups then need snapshots even while no group
    /// request comes (`CoreBroker::snapshot_idle_groups`), after a restart too.
    pub group_batches_seen: Cell<bool>,
    /// The log's size when its groups were last snapshotted or let go, as far as this
    /// core knows (at open: the size then).
    pub groups_snapshot_mark: Cell<u64>,
    /// Where retention knows this log's group snapshots lie.
    pub group_snapshot_scan: Cell<crate::groups::SnapshotScan>,
    /// The groups are built again only once the log holds this far acknowledged
    /// (see [`StreamShard::forget_groups_until`]); 0 when nothing waits.
    pub groups_settle_at: Cell<u64>,
    /// Set when the shard is moving to another core: long polls answer at once.
    pub closing: std::cell::Cell<bool>,
    /// One past the newest atomic commit claimed here, or the log's end when this core
    /// began writing it (a new leader's log may hold a predecessor's commits not yet
    /// visible): the state index covers every commit once it reaches this.
    pub commits_claimed: Cell<u64>,
}

impl std::fmt::Debug for StreamShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamShard")
            .field("key", &self.key)
            .finish()
    }
}

impl StreamShard {
    /// Wraps an opened log.
    pub fn new(key: Arc<ShardKey>, log: SegmentLog<DmaBackend>) -> StreamShard {
        let size = log.written_bytes();
        let groups_in_log = log.may_hold(felix_storage_uring::BatchKind::Group);
        StreamShard {
            commits_claimed: Cell::new(log.next_offset()),
            fanout_end: Cell::new(log.committed_end()),
            key,
            log,
            interested: RefCell::default(),
            appended: crate::groups::Wakers::default(),
            state: RefCell::default(),
            producers: RefCell::default(),
            idempotent_queue: RefCell::default(),
            building_producers: std::cell::Cell::new(false),
            untagged_from: Cell::new(None),
            producers_epoch: Cell::new(0),
            producers_snapshot_mark: Cell::new(size),
            producer_batches_stored: Cell::new(false),
            saving_producers: Cell::new(false),
            groups: RefCell::default(),
            building_groups: std::cell::Cell::new(false),
            handed_groups: RefCell::default(),
            group_batches_seen: Cell::new(groups_in_log),
            groups_snapshot_mark: Cell::new(size),
            group_snapshot_scan: Cell::default(),
            groups_settle_at: Cell::new(0),
            closing: std::cell::Cell::new(false),
        }
    }

    /// Registers a subscriber on `core` and returns the offset live delivery starts at.
    /// Everything below it is in the log; everything at or after it will be delivered
    /// to `core`. Synchronous, so no append can slip between the two.
    pub fn register(&self, core: CoreId) -> u64 {
        *self.interested.borrow_mut().entry(core).or_default() += 1;
        self.fanout_end.get()
    }

    /// Registers `n` subscribers on `core` (handed over by a live re-pin).
    pub fn register_many(&self, core: CoreId, n: usize) {
        *self.interested.borrow_mut().entry(core).or_default() += n;
    }

    /// Cores with subscribers and how many (handed over by a live re-pin).
    pub fn interest(&self) -> Vec<(CoreId, usize)> {
        self.interested
            .borrow()
            .iter()
            .map(|(c, n)| (*c, *n))
            .collect()
    }

    /// Drops one subscriber of `core`.
    pub fn unregister(&self, core: CoreId) {
        let mut m = self.interested.borrow_mut();
        if let Some(n) = m.get_mut(&core) {
            *n -= 1;
            if *n == 0 {
                m.remove(&core);
            }
        }
    }

    /// Cores to fan a committed batch out to.
    pub fn interested_cores(&self) -> Vec<CoreId> {
        self.interested.borrow().keys().copied().collect()
    }

    /// Records that `appended` was fanned out. Called right after its commit returned,
    /// before any other `.await`, so it runs in offset order.
    pub fn advance_fanout(&self, appended: Appended) {
        debug_assert!(
            appended.first >= self.fanout_end.get() || appended.end <= self.fanout_end.get()
        );
        self.fanout_end.set(self.fanout_end.get().max(appended.end));
        self.appended.wake_all();
    }

    /// Next offset to fan out.
    pub fn fanout_end(&self) -> u64 {
        self.fanout_end.get()
    }

    /// Moves the fanout frontier to `end` (a replica that starts or stops leading, or
    /// whose suffix was cut).
    pub fn reset_fanout(&self, end: u64) {
        self.fanout_end.set(end);
        // What the log holds may have changed under the state index: build it again.
        *self.state.borrow_mut() = None;
        self.commits_claimed.set(self.log.next_offset());
        *self.producers.borrow_mut() = None;
        self.untagged_from.set(None);
        self.producers_epoch.set(self.producers_epoch.get() + 1);
        // A new generation: what it builds from waits for nothing of the last one's.
        self.groups_settle_at.set(0);
        self.forget_groups();
        self.appended.wake_all();
    }

    /// [`StreamShard::forget_groups`], and the next build waits until the log holds
    /// everything up to `end`: the groups were dropped after a write whose outcome is
    /// unknown, and a fold of the log without it (or without a write still in flight on
    /// the dropped groups, answered from them) would be other than the log.
    pub fn forget_groups_until(&self, end: u64) {
        self.groups_settle_at
            .set(self.groups_settle_at.get().max(end));
        self.forget_groups();
    }

    /// Drops the groups built from the log: retired, so requests still running on them
    /// write nothing more; the next group request builds them again from the log.
    pub fn forget_groups(&self) {
        if let Some(groups) = self.groups.borrow_mut().take() {
            groups.retire();
            self.groups_snapshot_mark.set(groups.snapshot_mark());
        }
        *self.handed_groups.borrow_mut() = None;
    }

    /// Notes a claim of `first..end` made on this core (tagged when idempotent), so the
    /// producer table stays current without reading the log back. A table that missed a
    /// claim (one made elsewhere, a generation start) is dropped and built again.
    pub fn note_claimed(&self, first: u64, end: u64, tag: Option<crate::producers::Tagged>) {
        let mut slot = self.producers.borrow_mut();
        let Some(table) = slot.as_mut() else {
            if self.untagged_from.get().is_none() {
                self.untagged_from.set(Some(first));
            }
            return;
        };
        if !table.claimed(first, end, tag) {
            // This claim (tagged, maybe) is read back from the log; those after it,
            // with no table, hold none.
            *slot = None;
            self.untagged_from.set(None);
        }
    }

    /// Whether anyone subscribes.
    pub fn has_subscribers(&self) -> bool {
        !self.interested.borrow().is_empty()
    }
}

/// A cache value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// The value.
    pub value: Bytes,
    /// The offset of the put that wrote it (kept by a compaction's copy).
    pub version: u64,
    /// Absolute expiry (ms since epoch); 0 = never.
    pub expires_at_ms: u64,
    /// The offset of the record it was last restated at (the put, or its copy).
    pub at: u64,
}

impl CacheEntry {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_at_ms == 0 || self.expires_at_ms > now_ms
    }
}

/// Cache record in the log (our format): `op u8` (0 put, 1 delete, 2 counter add), then
/// `expires_at_ms u64` (put; 0 for the others) or the counter's signed delta (add, as
/// i64), `key_len u16`, key UTF-8, then the value (put only). Big-endian. Counters share
/// the cache's log and its replication, but not its keys: a cache value and a counter may
/// have the same key and are unrelated.
pub fn encode_cache_record(put: bool, expires_at_ms: u64, key: &str, value: &[u8]) -> Bytes {
    encode(u8::from(!put), expires_at_ms, key, value)
}

/// A counter add record (op 2).
pub fn encode_counter_record(key: &str, delta: i64) -> Bytes {
    encode(2, delta as u64, key, &[])
}

/// A compaction's copy of a live value (op 3): a put that keeps the version of the put
/// it copies (`u64` version first in the value part), so conditional writes see the
/// same version after compaction.
pub fn encode_carried_put(key: &str, expires_at_ms: u64, version: u64, value: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(8 + value.len());
    v.extend_from_slice(&version.to_be_bytes());
    v.extend_from_slice(value);
    encode(3, expires_at_ms, key, &v)
}

/// A compaction's checkpoint of a counter (op 4): the sum, replacing the deltas before.
pub fn encode_counter_checkpoint(key: &str, sum: i64) -> Bytes {
    encode(4, sum as u64, key, &[])
}

/// A replicated compaction's cut marker (op 5, no key): every live value below `cut` has
/// a copy between `cut` and this record. Once the marker is committed, each replica
/// removes its segments below `cut` on its own.
pub fn encode_cut_marker(cut: u64) -> Bytes {
    encode(5, cut, "", &[])
}

fn encode(op: u8, word: u64, key: &str, value: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(11 + key.len() + value.len());
    b.put_u8(op);
    b.put_u64(word);
    b.put_u16(key.len() as u16);
    b.put_slice(key.as_bytes());
    b.put_slice(value);
    b.freeze()
}

/// What a cache record does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordOp {
    /// Set the key.
    Put,
    /// Remove the key.
    Delete,
    /// Add a signed delta to the counter of that key.
    Add(i64),
    /// Set the counter of that key (a compaction's checkpoint).
    Set(i64),
    /// A replicated compaction's cut at this offset (see [`encode_cut_marker`]).
    Cut(u64),
}

/// A decoded cache record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheRecord {
    /// What it does.
    pub op: RecordOp,
    /// Expiry (puts).
    pub expires_at_ms: u64,
    /// Key.
    pub key: String,
    /// Value (puts).
    pub value: Bytes,
    /// The version a compaction's copy keeps (otherwise the record's offset).
    pub carried: Option<u64>,
}

/// Reads a cache record; `None` when malformed.
pub fn decode_cache_record(r: &Bytes) -> Option<CacheRecord> {
    let op = *r.first()?;
    let word = u64::from_be_bytes(r.get(1..9)?.try_into().ok()?);
    let klen = usize::from(u16::from_be_bytes(r.get(9..11)?.try_into().ok()?));
    let key = std::str::from_utf8(r.get(11..11 + klen)?).ok()?.to_owned();
    let value = r.slice(11 + klen..);
    let (op, expires_at_ms, value, carried) = match op {
        0 => (RecordOp::Put, word, value, None),
        1 if value.is_empty() => (RecordOp::Delete, 0, value, None),
        2 if value.is_empty() => (RecordOp::Add(word as i64), 0, value, None),
        3 if value.len() >= 8 => {
            let version = u64::from_be_bytes(value[..8].try_into().ok()?);
            (RecordOp::Put, word, value.slice(8..), Some(version))
        }
        4 if value.is_empty() => (RecordOp::Set(word as i64), 0, value, None),
        5 if value.is_empty() && key.is_empty() => (RecordOp::Cut(word), 0, value, None),
        _ => return None,
    };
    Some(CacheRecord {
        op,
        expires_at_ms,
        key,
        value,
        carried,
    })
}

/// What a cache log describes: the live values and the counters, up to `end`.
#[derive(Debug, Default)]
struct Projection {
    index: HashMap<String, CacheEntry>,
    /// The keys of `index` whose value has a time to live, by when it ends: expiry
    /// looks at the expired ones only (it scanned the whole index every second).
    expiring: std::collections::BTreeSet<(u64, String)>,
    counters: HashMap<String, i64>,
    /// Every record below it is applied.
    end: u64,
    /// The newest cut marker held: (its offset, the cut).
    cut_marker: Option<(u64, u64)>,
    /// The changes applied recently, while the shard is watched: watchers that keep up
    /// are answered from it, not the log. A rebuilt index starts without one.
    recent: Option<Recent>,
}

/// The live entries of `state` that `filter` follows (one key is looked up, not found
/// by a scan of every key on the core).
fn followed<'a>(
    state: &'a Projection,
    filter: &'a WatchFilter,
    now: Now,
) -> impl Iterator<Item = (&'a String, &'a CacheEntry)> + 'a {
    let entries: Box<dyn Iterator<Item = (&String, &CacheEntry)>> = match filter {
        WatchFilter::Key(k) => Box::new(state.index.get_key_value(k).into_iter()),
        WatchFilter::Prefix(_) => Box::new(state.index.iter()),
    };
    entries.filter(move |(k, e)| filter.matches(k) && e.live(now.wall_ms()))
}

/// Which keys a cache watch follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchFilter {
    /// Exactly this key.
    Key(String),
    /// Every key beginning with this (`""`: every key of the shard).
    Prefix(String),
}

impl WatchFilter {
    /// Whether `key` is followed.
    pub fn matches(&self, key: &str) -> bool {
        match self {
            WatchFilter::Key(k) => k == key,
            WatchFilter::Prefix(p) => key.starts_with(p.as_str()),
        }
    }
}

/// One change a cache watch delivers: a put (`value` set) or a delete, at `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchChange {
    /// Key.
    pub key: String,
    /// The new value; `None` for a delete.
    pub value: Option<Bytes>,
    /// The record's offset (a put's version).
    pub offset: u64,
    /// Absolute expiry in ms, 0 = never.
    pub expires_at_ms: u64,
}

/// What [`CacheShard::changes`] found.
#[derive(Debug)]
pub struct Changes {
    /// The changes, in offset order.
    pub changes: Vec<WatchChange>,
    /// Where the next read starts.
    pub next: u64,
    /// Read from the log (the recent changes did not reach back far enough).
    pub from_log: bool,
}

/// The metadata file holding a cache log's life (see [`life_of`]).
const LIFE_META: &str = "cache-life";

/// The life of a cache's log: a number kept with the log from its first open, the same
/// however often it is opened (a re-pin opens it on another core, a restart again),
/// another once the cache is deleted and made again (a new directory). Should it not
/// be kept, each opening has a number of its own (watches then end at a re-pin too).
async fn life_of(key: &ShardKey, log: &SegmentLog<DmaBackend>) -> u64 {
    let kept = match log.read_meta(LIFE_META).await {
        Ok(kept) => kept,
        Err(e) => {
            // Not read (out of descriptors, say): this opening's own, the kept one left.
            tracing::warn!(shard = %key, error = %e, "reading a cache log's life number");
            return rand::random();
        }
    };
    if let Some(b) = kept
        && let Ok(b) = <[u8; 8]>::try_from(&b[..])
    {
        return u64::from_be_bytes(b);
    }
    let life = rand::random::<u64>();
    if let Err(e) = log.write_meta(LIFE_META, &life.to_be_bytes()).await {
        tracing::warn!(shard = %key, error = %e, "keeping a cache log's life number");
    }
    life
}

/// Past a write's `QUORUM_WAIT`, how long its log write is allowed before the writes
/// waiting for it stop waiting (see `CacheShard::settle_by`).
const SETTLE_MARGIN: std::time::Duration = std::time::Duration::from_secs(1);

/// A cache shard on its owning core: the log plus the key index derived from it.
pub struct CacheShard {
    /// Which shard.
    pub key: Arc<ShardKey>,
    /// The life of its log (see [`life_of`]): a watch that finds another than the one
    /// it started on ends (the cache was deleted and made again under the name, or its
    /// damaged copy was set aside and started over; reads go by name).
    pub life: u64,
    log: SegmentLog<DmaBackend>,
    state: RefCell<Projection>,
    /// Woken whenever records are applied and whenever a write in flight is done:
    /// compactions waiting for the applied end or for a key look again. (Writes waiting
    /// for their key wait apart: `queued`, `settling`.)
    pub changed: crate::groups::Wakers,
    /// Watches waiting for a change, woken by the changes they follow (see
    /// [`CacheShard::change_followed`]).
    watching: RefCell<Waiting>,
    /// Writes claimed but not yet applied, per key: a conditional write waits for them,
    /// so its condition is checked against every write before it.
    in_flight: RefCell<HashMap<String, u32>>,
    /// When every write of the key in flight has given up waiting for a majority (each
    /// waits at most `QUORUM_WAIT` once in the log, then answers outcome-unknown and
    /// stays in flight until it commits or leadership changes): a write waiting for
    /// them waits no longer. Writes queued behind one that never settled each waited a
    /// full `QUORUM_WAIT` of their own, in turn.
    settle_by: RefCell<HashMap<String, std::time::Instant>>,
    /// Writes of a key waiting to claim their place in the log, per key, in arrival
    /// order ([`Ticket`] numbers). A write that waits before it claims (a conditional
    /// write, a replicated delete: for the key's earlier writes to apply) takes a ticket,
    /// and so does every write of the key that comes while one is held; each claims only
    /// at the front. Writes of one key pipelined on a stream so land in the order sent:
    /// a put sent after a waiting delete claimed first, and the delete then removed the
    /// acknowledged put.
    /// Each waits with its waker there, woken alone when it comes to the front.
    queued: RefCell<HashMap<String, TicketQueue>>,
    /// Writes waiting for a key's writes in flight to be done ([`CacheShard::key_settled`]),
    /// per key: woken when the key's last one is, not at every change of the shard.
    settling: RefCell<HashMap<String, std::rc::Rc<crate::groups::Wakers>>>,
    /// The last ticket number handed out.
    tickets: Cell<u64>,
    /// Adds claimed but not yet applied, per counter (a compaction checkpoints a counter
    /// only while it has none). Apart from `in_flight`: counters and keys are named
    /// apart, and a key named like a counter's guard stalled every compaction.
    counters_in_flight: RefCell<HashMap<String, u32>>,
    /// Counters a compaction is checkpointing whose new adds wait ([`CacheShard::add_turn`])
    /// until it lets go: the adds in flight drain, so a counter added to without a gap
    /// (pipelined adds, each claimed before the one ahead of it applied) is checkpointed
    /// too, where every compaction gave up on it and the log grew for good.
    adds_held: RefCell<std::collections::HashSet<String>>,
    /// Adds claimed but not yet applied, per counter: the sum of their positive and of
    /// their negative deltas. A new add is checked against the applied sum plus each,
    /// so whichever of them land the counter stays within i64.
    adding: RefCell<HashMap<String, (i128, i128)>>,
    /// Records this broker claimed while leading the replicated cache and has not
    /// applied yet, by offset ([`CacheShard::stage`]). They reach the index in log order
    /// once committed ([`CacheShard::apply_through`]), whether or not the request that
    /// wrote one still waits for it: a write whose wait gave up (answered outcome-unknown)
    /// may commit later, and the index must follow the log. Each holds its key (or
    /// counter) in flight until applied, so conditional writes and compactions wait for
    /// it, and the applied end stops below the first (watchers read no further).
    staged: RefCell<std::collections::BTreeMap<u64, (Bytes, AppliedSum)>>,
    /// Writes since the last compaction.
    writes: std::cell::Cell<u64>,
    /// A compaction is running.
    compacting: std::cell::Cell<bool>,
    /// Keys compactions looked at while picking what to copy (work bound: each is
    /// looked at a bounded number of times).
    compact_examined: std::cell::Cell<u64>,
    /// Values expiry looked at (work bound: the expired ones).
    expiry_examined: std::cell::Cell<u64>,
    /// Looks waiting writes took at their key's queue or writes in flight (work bound:
    /// about one each time their key's state changed).
    waits_looked: std::cell::Cell<u64>,
}

/// What one compaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    /// The cut: everything below it was removed, what was live copied past it.
    pub cut: u64,
    /// Values copied.
    pub values: usize,
    /// Counters checkpointed.
    pub counters: usize,
    /// Segments removed.
    pub segments: usize,
}

/// The keys a compaction has still to copy past its cut: those holding a value below it
/// when it began, in turn, then the ones it found with a write in flight.
#[derive(Debug, Default)]
struct ToCopy {
    keys: Vec<String>,
    next: usize,
    deferred: Vec<String>,
}

/// What a compaction copies next.
enum Picked {
    /// These values.
    Copy(Vec<(String, CacheEntry)>),
    /// Nothing now: the values left below the cut have writes in flight.
    Wait,
    /// Everything live is past the cut.
    Done,
}

/// Live values or counters one compaction batch copies.
const COMPACT_BATCH: usize = 64;
/// Bytes of values one compaction batch copies at most (one value over it goes alone):
/// 64 values of a megabyte passed the log's batch bound and every compaction of the
/// cache failed, its log growing for good.
const COMPACT_BATCH_BYTES: usize = 4 << 20;
/// How long a compaction waits for the writes below its cut to reach the index.
const COMPACT_APPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a compaction holds back new adds of the counters it waits to checkpoint
/// (the adds in flight need a flush round, or a replication round, to drain), before it
/// gives up and lets them go.
const COMPACT_HOLD_ADDS: std::time::Duration = std::time::Duration::from_secs(2);

/// The compaction's hold on new adds ([`CacheShard::adds_held`], which only the one
/// compaction a shard runs at a time fills): dropped, it lets every held counter go,
/// whatever way the compaction ended.
struct HeldAdds<'a> {
    shard: &'a CacheShard,
}

impl HeldAdds<'_> {
    /// Lets the adds of `done` go (their checkpoints are written: adds claimed from now
    /// on land above them).
    fn release(&self, done: &[String]) {
        let mut held = self.shard.adds_held.borrow_mut();
        let mut released = false;
        for n in done {
            released |= held.remove(n);
        }
        drop(held);
        if released {
            self.shard.changed.wake_all();
        }
    }
}

impl Drop for HeldAdds<'_> {
    fn drop(&mut self) {
        let held = std::mem::take(&mut *self.shard.adds_held.borrow_mut());
        if !held.is_empty() {
            self.shard.changed.wake_all();
        }
    }
}

/// A key's write in flight, from its claim until it is applied (or failed).
#[derive(Debug)]
pub struct KeyWrite<'a> {
    shard: &'a CacheShard,
    /// Where it is counted: the keys' writes or the counters' adds.
    map: &'a RefCell<HashMap<String, u32>>,
    key: String,
}

impl Drop for KeyWrite<'_> {
    fn drop(&mut self) {
        if std::ptr::eq(self.map, &self.shard.in_flight) {
            // (Its deadline goes with the key's last write in flight.)
            self.shard.mark_key(&self.key, false);
        } else {
            self.shard.mark(self.map, &self.key, false);
        }
    }
}

/// A key's writes waiting to claim, in arrival order: each ticket's number, and its
/// waker while it waits for its turn.
type TicketQueue = std::collections::VecDeque<(u64, Option<Waker>)>;

/// A write's place in its key's queue of writes waiting to claim
/// ([`CacheShard::ticket`]): it claims at the front, and lets the next go when dropped.
#[derive(Debug)]
pub struct Ticket<'a> {
    shard: &'a CacheShard,
    key: String,
    id: u64,
}

impl Ticket<'_> {
    /// Waits until every write of the key that took a ticket before this one claimed
    /// its place or gave up.
    pub async fn turn(&self) {
        std::future::poll_fn(|cx| {
            let looked = &self.shard.waits_looked;
            looked.set(looked.get() + 1);
            let mut queued = self.shard.queued.borrow_mut();
            let Some(q) = queued.get_mut(&self.key) else {
                return Poll::Ready(());
            };
            // Tickets queue in the order they were taken, their numbers rising.
            match q.binary_search_by_key(&self.id, |(id, _)| *id) {
                Ok(0) | Err(_) => Poll::Ready(()),
                Ok(at) => {
                    q[at].1 = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await;
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut queued = self.shard.queued.borrow_mut();
        let mut next = None;
        if let Some(q) = queued.get_mut(&self.key) {
            q.retain(|(id, _)| *id != self.id);
            match q.front_mut() {
                // The key's next write in line, whose turn it may now be.
                Some((_, waker)) => next = waker.take(),
                None => {
                    queued.remove(&self.key);
                }
            }
        }
        drop(queued);
        if let Some(w) = next {
            w.wake();
        }
    }
}

/// A staged add's counter sum right after it was applied ([`CacheShard::stage`]).
pub type AppliedSum = std::rc::Rc<std::cell::Cell<Option<i64>>>;

/// An add to a counter in flight ([`CacheShard::begin_add`]): also a write of the
/// counter, so a compaction checkpoints it only once none is.
#[derive(Debug)]
pub struct AddInFlight<'a> {
    _write: KeyWrite<'a>,
    shard: &'a CacheShard,
    key: String,
    delta: i128,
}

impl Drop for AddInFlight<'_> {
    fn drop(&mut self) {
        self.shard.mark_add(&self.key, self.delta, false);
    }
}

impl std::fmt::Debug for CacheShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheShard")
            .field("key", &self.key)
            .finish()
    }
}

impl CacheShard {
    /// Wraps an opened log, rebuilding the index by replaying it.
    pub async fn open(
        key: Arc<ShardKey>,
        log: SegmentLog<DmaBackend>,
    ) -> Result<CacheShard, BrokerError> {
        let state = replay(&key, &log).await?;
        let life = life_of(&key, &log).await;
        Ok(CacheShard {
            key,
            life,
            log,
            state: RefCell::new(state),
            changed: crate::groups::Wakers::default(),
            watching: RefCell::default(),
            in_flight: RefCell::default(),
            settle_by: RefCell::default(),
            queued: RefCell::default(),
            settling: RefCell::default(),
            tickets: Cell::new(0),
            counters_in_flight: RefCell::default(),
            adds_held: RefCell::default(),
            adding: RefCell::default(),
            staged: RefCell::default(),
            writes: std::cell::Cell::new(0),
            compacting: std::cell::Cell::new(false),
            compact_examined: std::cell::Cell::new(0),
            expiry_examined: std::cell::Cell::new(0),
            waits_looked: std::cell::Cell::new(0),
        })
    }

    /// Rebuilds the index from the log (a replica whose suffix was cut, or that starts
    /// leading).
    pub async fn rebuild(&self) -> Result<(), BrokerError> {
        self.rebuild_if(|| true).await.map(|_| ())
    }

    /// [`CacheShard::rebuild`], the index installed only if `still` holds once the log
    /// is read (a leadership that began meanwhile rebuilt and staged writes of its own,
    /// which an older rebuild finishing later would drop). Returns whether installed.
    pub async fn rebuild_if(&self, still: impl Fn() -> bool) -> Result<bool, BrokerError> {
        let state = replay(&self.key, &self.log).await?;
        if !still() {
            return Ok(false);
        }
        *self.state.borrow_mut() = state;
        // What an earlier leadership staged is in the replayed log or was cut from it.
        self.drop_staged();
        self.changed.wake_all();
        self.watching.borrow_mut().wake_all();
        Ok(true)
    }

    /// A record this broker, leading the replicated cache, claimed at `offset`: held in
    /// flight until [`CacheShard::apply_through`] applies it (see the `staged` field).
    /// Called right after the claim, with no wait in between. For a counter's add, the
    /// answer is the sum right after it, which the application fills in (a later add may
    /// be applied with it, and must not show in this one's answer).
    pub fn stage(&self, offset: u64, record: &Bytes, claimed_at: std::time::Instant) -> AppliedSum {
        let sum = AppliedSum::default();
        let replaced = self
            .staged
            .borrow_mut()
            .insert(offset, (record.clone(), sum.clone()));
        if let Some((old, _)) = replaced {
            // Offsets given back by a rollback and claimed again: the old record is not
            // in the log.
            self.hold(&old, false);
        }
        self.hold(record, true);
        if let Some(rec) = decode_cache_record(record)
            && matches!(rec.op, RecordOp::Put | RecordOp::Delete)
        {
            // Its log write first (a second is ample), then its majority wait.
            let by = claimed_at + crate::replication::replica::QUORUM_WAIT + SETTLE_MARGIN;
            let mut settle_by = self.settle_by.borrow_mut();
            let at = settle_by.entry(rec.key.to_owned()).or_insert(by);
            *at = (*at).max(by);
        }
        sum
    }

    /// When the writes of `key` in flight have all given up waiting for a majority
    /// (None: none in flight).
    pub fn settle_by(&self, key: &str) -> Option<std::time::Instant> {
        self.settle_by.borrow().get(key).copied()
    }

    /// A staged record whose write failed before it reached the log (the log may give
    /// its offset back): no longer staged, its key let go. Only if still the one
    /// staged there (`sum` tells).
    pub fn unstage(&self, offset: u64, sum: &AppliedSum) {
        let removed = {
            let mut staged = self.staged.borrow_mut();
            match staged.get(&offset) {
                Some((_, s)) if std::rc::Rc::ptr_eq(s, sum) => staged.remove(&offset),
                _ => None,
            }
        };
        if let Some((record, _)) = removed {
            self.hold(&record, false);
            // The applied end may have moved past changes applied behind it.
            self.watching.borrow_mut().wake_all();
        }
    }

    /// Drops everything staged (this replica stopped leading: what it staged is in its
    /// log or will be cut from it, and the index is rebuilt before it serves again).
    /// Its callers wake the waiting watches (a rebuild, a step-down).
    pub fn drop_staged(&self) {
        let staged = std::mem::take(&mut *self.staged.borrow_mut());
        for (record, _) in staged.values() {
            self.hold(record, false);
        }
    }

    /// Whether a write of `key` is claimed and not yet applied.
    pub fn write_in_flight(&self, key: &str) -> bool {
        self.in_flight.borrow().contains_key(key)
    }

    /// Applies, in log order, every staged record below `bound` (what is committed and
    /// may be read), and lets go of what each held.
    pub fn apply_through(&self, bound: u64) {
        loop {
            let next = {
                let mut staged = self.staged.borrow_mut();
                match staged.first_key_value() {
                    Some((&offset, _)) if offset < bound => staged.pop_first(),
                    _ => None,
                }
            };
            let Some((offset, (record, sum))) = next else {
                return;
            };
            self.apply_stored(offset, std::slice::from_ref(&record));
            if let Some(CacheRecord {
                op: RecordOp::Add(_),
                key,
                ..
            }) = decode_cache_record(&record)
            {
                sum.set(self.counter(&key));
            }
            self.hold(&record, false);
        }
    }

    /// Marks (`on`) or unmarks the key, or counter and its delta, a staged record writes
    /// as in flight, as [`CacheShard::key_write`] and [`CacheShard::begin_add`] do.
    fn hold(&self, record: &Bytes, on: bool) {
        let Some(rec) = decode_cache_record(record) else {
            return;
        };
        match rec.op {
            RecordOp::Put | RecordOp::Delete => self.mark_key(&rec.key, on),
            RecordOp::Add(delta) => {
                self.mark_add(&rec.key, i128::from(delta), on);
                self.mark(&self.counters_in_flight, &rec.key, on);
            }
            RecordOp::Set(_) | RecordOp::Cut(_) => {}
        }
    }

    /// Counts a write of `key` in flight (`on`) or done (waking whoever waits for it).
    fn mark_key(&self, key: &str, on: bool) {
        self.mark(&self.in_flight, key, on);
        if !on && !self.in_flight.borrow().contains_key(key) {
            self.settle_by.borrow_mut().remove(key);
            // Emptiness first: a write nobody waits for (nearly every one) hashes its
            // key no more for this.
            let settled = {
                let mut settling = self.settling.borrow_mut();
                (!settling.is_empty())
                    .then(|| settling.remove(key))
                    .flatten()
            };
            if let Some(waiting) = settled {
                waiting.wake_all();
            }
        }
    }

    /// Counts a write of `name` in flight in `map` (`on`) or done (waking whoever waits).
    fn mark(&self, map: &RefCell<HashMap<String, u32>>, key: &str, on: bool) {
        let mut m = map.borrow_mut();
        if on {
            *m.entry(key.to_owned()).or_default() += 1;
            return;
        }
        if let Some(n) = m.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                m.remove(key);
            }
        }
        drop(m);
        self.changed.wake_all();
    }

    /// Counts an add of `delta` to counter `key` in flight (`on`) or done: the sums of
    /// the positive and of the negative deltas in flight, checked by `add_room`.
    fn mark_add(&self, key: &str, delta: i128, on: bool) {
        let (up, down) = (delta.max(0), delta.min(0));
        let mut adding = self.adding.borrow_mut();
        let e = adding.entry(key.to_owned()).or_insert((0, 0));
        *e = if on {
            (e.0 + up, e.1 + down)
        } else {
            (e.0 - up, e.1 - down)
        };
        if *e == (0, 0) {
            adding.remove(key);
        }
    }

    /// Applies records stored at `base..` (by a follower, or a leader's replicated
    /// write once it may be read) to the index.
    pub fn apply_stored(&self, base: u64, records: &[Bytes]) {
        let mut state = self.state.borrow_mut();
        for (i, r) in records.iter().enumerate() {
            if let Some(rec) = decode_cache_record(r) {
                // A compaction's own records (copies, checkpoints, its marker) are not
                // writes that make the next compaction due.
                let own =
                    rec.carried.is_some() || matches!(rec.op, RecordOp::Set(_) | RecordOp::Cut(_));
                if !own {
                    self.writes.set(self.writes.get() + 1);
                }
                if is_change(&rec) {
                    // Woken tasks run after this: the change is applied by then.
                    self.watching.borrow_mut().wake_following(&rec.key);
                }
                apply(&mut state, rec, base + i as u64);
            }
        }
        state.end = state.end.max(base + records.len() as u64);
        self.changed.wake_all();
    }

    /// A follower stored these data batches (`(base, records)`): it keeps only their cut
    /// markers (its index is rebuilt when it leads).
    pub fn note_stored<'a>(&self, batches: impl IntoIterator<Item = (u64, &'a [Bytes])>) {
        for (base, records) in batches {
            for (i, r) in records.iter().enumerate() {
                if r.first() == Some(&5)
                    && let Some(CacheRecord {
                        op: RecordOp::Cut(cut),
                        ..
                    }) = decode_cache_record(r)
                {
                    self.state.borrow_mut().cut_marker = Some((base + i as u64, cut));
                }
            }
        }
    }

    /// The newest replicated compaction's cut marker this replica holds: (the marker's
    /// offset, the cut). Segments below the cut may go once the marker is committed.
    pub fn cut_marker(&self) -> Option<(u64, u64)> {
        self.state.borrow().cut_marker
    }

    /// The log was cut to end at `end` and the index could not be rebuilt: a marker that
    /// went with the cut must not let segments go (its copies went with it), though the
    /// offset it sat at may commit again holding something else.
    pub fn forget_cut_marker_from(&self, end: u64) {
        let mut state = self.state.borrow_mut();
        if state.cut_marker.is_some_and(|(at, _)| at >= end) {
            state.cut_marker = None;
        }
    }

    /// The value of `key` live at `now`.
    pub fn get(&self, key: &str, now: Now) -> Option<CacheEntry> {
        self.state
            .borrow()
            .index
            .get(key)
            .filter(|e| e.live(now.wall_ms()))
            .cloned()
    }

    /// Writes `key` at `now`; resolves when durable per the fsync mode. Returns the
    /// version.
    pub async fn put(
        &self,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
        now: Now,
    ) -> Result<u64, BrokerError> {
        self.put_in_turn(None, key, value, ttl_ms, now).await
    }

    /// [`CacheShard::put`] by a write whose turn came (`ticket`: let go once claimed).
    pub async fn put_in_turn(
        &self,
        ticket: Option<Ticket<'_>>,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
        now: Now,
    ) -> Result<u64, BrokerError> {
        // Saturating: a client's TTL near u64::MAX means "as long as can be", not a
        // value stored already expired (or, with overflow checks, a panic).
        let expires = ttl_ms.map_or(0, |t| now.wall_ms().saturating_add(t.max(1)));
        let rec = encode_cache_record(true, expires, key, &value);
        let _writing = self.key_write(key);
        let pending = self.log.begin_append(&[rec], now.wall_micros, None)?;
        drop(ticket);
        self.writes.set(self.writes.get() + 1);
        let appended = self.log.commit(pending).await?;
        // In commit order (no await since the commit returned): the index follows the log.
        apply(
            &mut self.state.borrow_mut(),
            CacheRecord {
                op: RecordOp::Put,
                expires_at_ms: expires,
                key: key.to_owned(),
                value,
                carried: None,
            },
            appended.first,
        );
        self.changed.wake_all();
        self.watching.borrow_mut().wake_following(key);
        Ok(appended.first)
    }

    /// Removes `key` at `now`; returns the value it removed (nothing is written when it
    /// had none and no write of it is in flight).
    pub async fn delete(&self, key: &str, now: Now) -> Result<Option<Bytes>, BrokerError> {
        self.delete_in_turn(None, key, now).await
    }

    /// [`CacheShard::delete`] by a write whose turn came (`ticket`: let go once claimed,
    /// or at once when there is nothing to delete).
    pub async fn delete_in_turn(
        &self,
        ticket: Option<Ticket<'_>>,
        key: &str,
        now: Now,
    ) -> Result<Option<Bytes>, BrokerError> {
        // A write of the key claimed before this delete (pipelined on one stream, say) is
        // not in the index until it is durable: looking only there, the delete found
        // nothing, wrote nothing, and the write landed after the acknowledged delete.
        // With one in flight the delete is written anyway, after it in the log, and
        // answers what it removed as it is applied (waiting for the key to settle could
        // wait for ever under a stream of writes).
        if !self.write_in_flight(key) && self.get(key, now).is_none() {
            return Ok(None);
        }
        self.write_delete(ticket, key, now).await
    }

    /// Up to `max` keys whose value expired by `now`, each with the version that expired.
    pub fn expired(&self, now: Now, max: usize) -> Vec<(String, u64)> {
        let now_ms = now.wall_ms();
        let st = self.state.borrow();
        let expired: Vec<(String, u64)> = st
            .expiring
            .iter()
            .take_while(|(at, _)| *at <= now_ms)
            .take(max)
            .filter_map(|(_, k)| {
                self.expiry_examined.set(self.expiry_examined.get() + 1);
                st.index.get(k).map(|e| (k.clone(), e.version))
            })
            .collect();
        expired
    }

    /// Whether `key` still holds the value written at `version` and it expired by `now`
    /// (a write of the key since, a refresh, wins).
    pub fn expired_at(&self, key: &str, version: u64, now: Now) -> bool {
        self.state
            .borrow()
            .index
            .get(key)
            .is_some_and(|e| e.version == version && !e.live(now.wall_ms()))
    }

    /// Writes a delete of `key` if its value at `version` expired by `now` and no write
    /// of the key is in flight; returns whether it wrote one. Watchers see the delete,
    /// and the value leaves the index and (at the next compaction) the disk. A key being
    /// written is looked at again at the next round, as on a replicated cache: this
    /// waited for the key to settle, and writers that kept one write of it in flight
    /// held the core's housekeeping (retention, compactions, group snapshots) for as
    /// long as they wrote.
    pub async fn expire(&self, key: &str, version: u64, now: Now) -> Result<bool, BrokerError> {
        if self.write_in_flight(key) || !self.expired_at(key, version, now) {
            return Ok(false);
        }
        self.write_delete(None, key, now).await?;
        Ok(true)
    }

    /// Writes a delete of `key`; returns the value live at `now` it removed, read as it
    /// is applied (in commit order: every write of the key before it is applied then).
    async fn write_delete(
        &self,
        ticket: Option<Ticket<'_>>,
        key: &str,
        now: Now,
    ) -> Result<Option<Bytes>, BrokerError> {
        let rec = encode_cache_record(false, 0, key, &[]);
        let _writing = self.key_write(key);
        let pending = self.log.begin_append(&[rec], now.wall_micros, None)?;
        drop(ticket);
        self.writes.set(self.writes.get() + 1);
        let appended = self.log.commit(pending).await?;
        let old = self.get(key, now).map(|e| e.value);
        apply(
            &mut self.state.borrow_mut(),
            CacheRecord {
                op: RecordOp::Delete,
                expires_at_ms: 0,
                key: key.to_owned(),
                value: Bytes::new(),
                carried: None,
            },
            appended.first,
        );
        self.changed.wake_all();
        self.watching.borrow_mut().wake_following(key);
        Ok(old)
    }

    /// Whether the log holds enough overwritten records to compact: more writes since
    /// the last compaction than `after` and than four times what is live.
    pub fn compaction_due(&self, after: u64) -> bool {
        if self.compacting.get() {
            return false;
        }
        let st = self.state.borrow();
        let live = (st.index.len() + st.counters.len()) as u64;
        self.writes.get() > after.max(4 * live)
    }

    /// Compacts the log: cuts it at its next offset, copies every value still live
    /// below the cut past it (keeping its version) and checkpoints every counter, then
    /// lets `writes` finish: a cache this broker alone holds removes the sealed segments
    /// below the cut at once; a replicated one writes a cut marker, and every replica
    /// removes its own segments below the cut once the marker is committed. Writes go on
    /// meanwhile; a key written again after the cut is not copied (its newer record is
    /// past the cut). Deleted values are simply not copied; an expired value whose delete
    /// is not written yet gets that delete past the cut instead of a copy.
    pub async fn compact(&self, writes: &impl CompactionWrites) -> Result<Compacted, BrokerError> {
        if self.compacting.replace(true) {
            return Err(BrokerError::Overloaded("compacting".into()));
        }
        let result = self.compact_now(writes).await;
        self.compacting.set(false);
        result
    }

    async fn compact_now(&self, writes: &impl CompactionWrites) -> Result<Compacted, BrokerError> {
        self.log.roll_next();
        let cut = self.log.next_offset();
        self.writes.set(0);
        // Everything below the cut applied: what the index says below it is final. (A
        // replicated write whose outcome was unknown is never applied: give up rather
        // than wait for it.)
        let applied = async {
            while self.applied_end() < cut {
                self.changed.changed().await;
            }
        };
        if felix_core_runtime::task::timeout(COMPACT_APPLY_WAIT, applied)
            .await
            .is_none()
        {
            return Err(BrokerError::Overloaded(
                "compaction: writes below the cut were not applied".into(),
            ));
        }
        let now = felix_core_runtime::clock::now();
        let mut values = 0;
        let mut give_up = std::time::Instant::now() + COMPACT_APPLY_WAIT;
        let mut todo = ToCopy {
            keys: (self.state.borrow().index.iter())
                .filter(|(_, e)| e.at < cut)
                .map(|(k, _)| k.clone())
                .collect(),
            ..ToCopy::default()
        };
        self.compact_examined
            .set(self.compact_examined.get() + todo.keys.len() as u64);
        loop {
            // Pick, claim and mark in one go (no wait in between): live values below
            // the cut whose key has no write in flight.
            let picked = self.pick_copies(cut, &mut todo);
            let batch = match picked {
                Picked::Done => break,
                Picked::Wait => {
                    // Left below the cut: values whose key has a write in flight. Wait
                    // for it (applied: the value is past the cut; failed: copy it),
                    // not for ever: nothing below the cut is removed on giving up.
                    let wait = give_up.saturating_duration_since(std::time::Instant::now());
                    if felix_core_runtime::task::timeout(wait, self.changed.changed())
                        .await
                        .is_none()
                    {
                        return Err(BrokerError::Overloaded(
                            "compaction: a value's write stayed in flight".into(),
                        ));
                    }
                    continue;
                }
                Picked::Copy(batch) => {
                    // The limit is each wait's, not the whole copy's.
                    give_up = std::time::Instant::now() + COMPACT_APPLY_WAIT;
                    batch
                }
            };
            let records: Vec<Bytes> = batch
                .iter()
                .map(|(k, e)| {
                    if e.live(now.wall_ms()) {
                        encode_carried_put(k, e.expires_at_ms, e.version, &e.value)
                    } else {
                        encode_cache_record(false, 0, k, &[])
                    }
                })
                .collect();
            let guards: Vec<_> = batch.iter().map(|(k, _)| self.key_write(k)).collect();
            // `append` claims its offsets before its first wait.
            let first = writes.append(&records, now.wall_micros).await?;
            writes.apply(self, first, &records);
            values += records.len();
            drop(guards);
        }
        // Counters: a checkpoint of each sum, taken while no add of it is in flight
        // (an add claimed below the checkpoint but applied after it would be lost on
        // replay). Picked, claimed and marked in one go, as values are: whichever have
        // none in flight now, so counters added to all the time are each caught at a
        // quiet moment rather than all at one.
        let mut left: std::collections::BTreeSet<String> =
            self.state.borrow().counters.keys().cloned().collect();
        let mut counters = 0;
        let mut give_up = std::time::Instant::now() + COMPACT_APPLY_WAIT;
        let held = HeldAdds { shard: self };
        // Whether new adds were held back once (they are once at most).
        let mut holding = false;
        while !left.is_empty() {
            let (chunk, records) = {
                let st = self.state.borrow();
                let inflight = self.counters_in_flight.borrow();
                let chunk: Vec<String> = left
                    .iter()
                    .filter(|n| !inflight.contains_key(*n))
                    .take(COMPACT_BATCH)
                    .cloned()
                    .collect();
                let records: Vec<Bytes> = chunk
                    .iter()
                    .filter_map(|n| st.counters.get(n).map(|s| encode_counter_checkpoint(n, *s)))
                    .collect();
                (chunk, records)
            };
            if chunk.is_empty() {
                // Each counter left has an add in flight: hold their new adds back and
                // wait for those in flight to land. Still in flight after that long (a
                // replicated add of unknown outcome): checkpoint them next time
                // (nothing below the cut is removed).
                if !holding {
                    holding = true;
                    self.adds_held.borrow_mut().extend(left.iter().cloned());
                    give_up = give_up.min(std::time::Instant::now() + COMPACT_HOLD_ADDS);
                }
                let wait = give_up.saturating_duration_since(std::time::Instant::now());
                if felix_core_runtime::task::timeout(wait, self.changed.changed())
                    .await
                    .is_none()
                {
                    return Err(BrokerError::Overloaded("compaction raced a counter".into()));
                }
                continue;
            }
            for n in &chunk {
                left.remove(n);
            }
            if records.is_empty() {
                held.release(&chunk);
                continue;
            }
            let guards: Vec<_> = chunk.iter().map(|n| self.counter_write(n)).collect();
            // `append` claims its offsets before its first wait.
            let first = writes.append(&records, now.wall_micros).await?;
            writes.apply(self, first, &records);
            counters += records.len();
            drop(guards);
            held.release(&chunk);
        }
        drop(held);
        let segments = writes.finish(cut, now.wall_micros).await?;
        Ok(Compacted {
            cut,
            values,
            counters,
            segments,
        })
    }

    fn apply_copies(&self, first: u64, records: &[Bytes]) {
        let mut st = self.state.borrow_mut();
        for (i, r) in records.iter().enumerate() {
            if let Some(rec) = decode_cache_record(r) {
                // The deletes of expired values it does not copy are changes.
                if is_change(&rec) {
                    self.watching.borrow_mut().wake_following(&rec.key);
                }
                apply(&mut st, rec, first + i as u64);
            }
        }
    }

    /// The next batch of values a compaction copies past `cut` (or deletes there,
    /// expired), from `todo`: each key is looked at once on its way through, and again
    /// only while a write of it is in flight.
    fn pick_copies(&self, cut: u64, todo: &mut ToCopy) -> Picked {
        let st = self.state.borrow();
        let inflight = self.in_flight.borrow();
        let looked = std::cell::Cell::new(0u64);
        let below_cut = |k: &String| {
            looked.set(looked.get() + 1);
            st.index.get(k).filter(|e| e.at < cut)
        };
        // An expired value whose delete is not written yet is carried as that delete:
        // dropped, it left the index only at the next open, and a watcher resuming
        // past the cut never saw it go.
        let mut bytes = 0usize;
        let mut batch: Vec<(String, CacheEntry)> = Vec::new();
        let picked = loop {
            let Some(k) = todo.keys.get(todo.next) else {
                // Through the keys: those found in flight go round again.
                todo.keys = std::mem::take(&mut todo.deferred);
                todo.next = 0;
                todo.keys.retain(|k| below_cut(k).is_some());
                if !batch.is_empty() {
                    break Picked::Copy(batch);
                }
                if todo.keys.is_empty() {
                    break Picked::Done;
                }
                if todo.keys.iter().all(|k| inflight.contains_key(k)) {
                    break Picked::Wait;
                }
                continue;
            };
            let Some(e) = below_cut(k) else {
                // Written again past the cut, or deleted, since the keys were taken.
                todo.next += 1;
                continue;
            };
            if inflight.contains_key(k) {
                todo.deferred.push(k.clone());
                todo.next += 1;
                continue;
            }
            bytes += k.len() + e.value.len() + 64;
            if !batch.is_empty() && bytes > COMPACT_BATCH_BYTES {
                // The next batch's first.
                break Picked::Copy(batch);
            }
            batch.push((k.clone(), e.clone()));
            todo.next += 1;
            if batch.len() == COMPACT_BATCH {
                break Picked::Copy(batch);
            }
        };
        self.compact_examined
            .set(self.compact_examined.get() + looked.get());
        picked
    }

    /// Marks an add to counter `name` in flight until the returned guard drops (a
    /// compaction checkpoints a counter only while none is).
    pub fn counter_write(&self, name: &str) -> KeyWrite<'_> {
        self.mark(&self.counters_in_flight, name, true);
        KeyWrite {
            shard: self,
            map: &self.counters_in_flight,
            key: name.to_owned(),
        }
    }

    /// Marks a write of `key` in flight until the returned guard drops.
    pub fn key_write(&self, key: &str) -> KeyWrite<'_> {
        self.mark_key(key, true);
        KeyWrite {
            shard: self,
            map: &self.in_flight,
            key: key.to_owned(),
        }
    }

    /// A place in `key`'s queue of writes waiting to claim (see `queued`), held until
    /// the write claims or gives up.
    pub fn ticket(&self, key: &str) -> Ticket<'_> {
        let id = self.tickets.get() + 1;
        self.tickets.set(id);
        self.queued
            .borrow_mut()
            .entry(key.to_owned())
            .or_default()
            .push_back((id, None));
        Ticket {
            shard: self,
            key: key.to_owned(),
            id,
        }
    }

    /// A ticket for a write that would claim at once: only while some write of `key`
    /// waits (none hashed in the common case, nothing waiting).
    pub fn ticket_if_queued(&self, key: &str) -> Option<Ticket<'_>> {
        let queued = {
            let q = self.queued.borrow();
            !q.is_empty() && q.contains_key(key)
        };
        queued.then(|| self.ticket(key))
    }

    /// Waits until no write of `key` is in flight.
    pub async fn key_settled(&self, key: &str) {
        while {
            self.waits_looked.set(self.waits_looked.get() + 1);
            self.in_flight.borrow().contains_key(key)
        } {
            let settled = self
                .settling
                .borrow_mut()
                .entry(key.to_owned())
                .or_default()
                .clone();
            settled.changed().await;
        }
    }

    /// Checks a conditional write's condition against the applied index: `Err` with the
    /// key's current version (none when absent) when it does not hold.
    pub fn condition_holds(
        &self,
        key: &str,
        condition: &felix_wire::message::CacheCondition,
        now: Now,
    ) -> Result<(), Option<u64>> {
        use felix_wire::message::CacheCondition;
        let current = self.get(key, now).map(|e| e.version);
        match (condition, current) {
            (CacheCondition::Absent, None) => Ok(()),
            (CacheCondition::Version(v), Some(c)) if *v == c => Ok(()),
            _ => Err(current),
        }
    }

    /// Every record below this offset is applied to the index.
    pub fn applied_end(&self) -> u64 {
        let end = self.state.borrow().end;
        // Contiguous: nothing at or past a staged record is visible to watchers.
        self.staged
            .borrow()
            .first_key_value()
            .map_or(end, |(&first, _)| end.min(first))
    }

    /// The live values the filter follows, oldest version first, and the offset the
    /// snapshot is as of (a watch continues from there).
    pub fn snapshot(&self, filter: &WatchFilter, now: Now) -> (Vec<WatchChange>, u64) {
        let state = self.state.borrow();
        let mut values: Vec<WatchChange> = followed(&state, filter, now)
            .map(|(k, e)| WatchChange {
                key: k.clone(),
                value: Some(e.value.clone()),
                offset: e.version,
                expires_at_ms: e.expires_at_ms,
            })
            .collect();
        values.sort_by_key(|c| c.offset);
        // Held for as long as the watcher takes to read it, and charged by its length.
        values.shrink_to_fit();
        drop(state);
        (values, self.applied_end())
    }

    /// What [`CacheShard::snapshot`] would copy, in
    /// [`snapshots::charged_bytes`](snapshots::charged_bytes), counted without copying.
    pub fn snapshot_bytes(&self, filter: &WatchFilter, now: Now) -> usize {
        let state = self.state.borrow();
        followed(&state, filter, now)
            .map(|(k, _)| std::mem::size_of::<WatchChange>() + k.len())
            .sum()
    }

    /// A watch begins on this shard, or asks for changes, at `now`: the recent changes
    /// are kept from now on (see [`recent`]).
    pub fn watch_waiting(&self, now: std::time::Instant) {
        let mut state = self.state.borrow_mut();
        let end = state.end;
        state
            .recent
            .get_or_insert_with(|| Recent::new(end, now))
            .watched(now);
    }

    /// Resolves once a change `filter` follows is applied after this is first polled,
    /// or every watch is woken to look again (the index rebuilt, a staged write given
    /// up, leadership lost): [`Wake::LookAgain`]; or to answer now because the shard is
    /// leaving this core or closing: [`Wake::Released`]. A watch waits on it with its
    /// position at the applied end.
    pub fn change_followed<'a>(&'a self, filter: &'a WatchFilter) -> Woken<'a> {
        Woken::new(&self.watching, filter)
    }

    /// Wakes every waiting watch to answer now (the shard is leaving this core: each
    /// lets it go, and its next request goes where the shard went).
    pub fn release_watches(&self) {
        self.watching.borrow_mut().release_all();
    }

    /// Wakes every waiting watch to look again (this replica stopped leading: each
    /// finds it no longer serves).
    pub fn recheck_watches(&self) {
        self.watching.borrow_mut().wake_all();
    }

    /// Drops the recent changes when no watch asked for `idle` before `now`.
    pub fn forget_recent_if_idle(&self, now: std::time::Instant, idle: std::time::Duration) {
        let mut state = self.state.borrow_mut();
        if state.recent.as_ref().is_some_and(|r| r.idle(now, idle)) {
            state.recent = None;
        }
    }

    /// Whether recent changes are kept (see [`recent`]).
    #[cfg(test)]
    fn keeps_recent(&self) -> bool {
        self.state.borrow().recent.is_some()
    }

    /// The puts and deletes the filter follows in `[from, applied end)`, at most about
    /// `max_bytes` of them (of log, when read from it), and where the next read starts:
    /// from the recent changes when they reach back to `from`, else from the log.
    pub async fn changes(
        &self,
        from: u64,
        filter: &WatchFilter,
        max_bytes: usize,
    ) -> Result<Changes, BrokerError> {
        let end = self.applied_end();
        if from >= end {
            return Ok(Changes {
                changes: Vec::new(),
                next: from,
                from_log: false,
            });
        }
        if let Some(recent) = &mut self.state.borrow_mut().recent
            && let Some((changes, next)) = recent.read(from, end, filter, max_bytes)
        {
            return Ok(Changes {
                changes,
                next,
                from_log: false,
            });
        }
        let mut out = Vec::new();
        let mut next = from;
        for b in self.log.read(from, max_bytes).await? {
            if b.base_offset >= end {
                break;
            }
            for (i, r) in b.records.iter().enumerate() {
                let offset = b.base_offset + i as u64;
                if offset < from || offset >= end || b.kind != BatchKind::Data {
                    continue;
                }
                let Some(rec) = decode_cache_record(r) else {
                    continue;
                };
                if !filter.matches(&rec.key) {
                    continue;
                }
                match rec.op {
                    // A compaction's copy restates a value; it is not a change.
                    RecordOp::Put if rec.carried.is_some() => {}
                    RecordOp::Put => out.push(WatchChange {
                        key: rec.key,
                        value: Some(rec.value),
                        offset,
                        expires_at_ms: rec.expires_at_ms,
                    }),
                    RecordOp::Delete => out.push(WatchChange {
                        key: rec.key,
                        value: None,
                        offset,
                        expires_at_ms: 0,
                    }),
                    RecordOp::Add(_) | RecordOp::Set(_) | RecordOp::Cut(_) => {}
                }
            }
            next = b.end_offset().min(end);
        }
        Ok(Changes {
            changes: out,
            next: next.max(from),
            from_log: true,
        })
    }

    /// The counter `key`: `None` when never written (which is not zero).
    pub fn counter(&self, key: &str) -> Option<i64> {
        self.state.borrow().counters.get(key).copied()
    }

    /// Claims an add of `delta` to the counter `key` until the returned guard drops
    /// (applied or failed): refused when it could take the counter past i64 with any of
    /// the adds already in flight landing or not. Check and claim in one step, so two
    /// adds racing to the edge cannot both pass.
    pub fn begin_add(&self, key: &str, delta: i64) -> Result<AddInFlight<'_>, BrokerError> {
        self.add_room(key, delta)?;
        self.mark_add(key, i128::from(delta), true);
        Ok(AddInFlight {
            _write: self.counter_write(key),
            shard: self,
            key: key.to_owned(),
            delta: i128::from(delta),
        })
    }

    /// Whether an add of `delta` to the counter `key` keeps it within i64 whichever of
    /// the adds in flight land.
    pub fn add_room(&self, key: &str, delta: i64) -> Result<(), BrokerError> {
        let sum = i128::from(self.counter(key).unwrap_or(0));
        let (up, down) = self.adding.borrow().get(key).copied().unwrap_or((0, 0));
        let d = i128::from(delta);
        let (up, down) = (up + d.max(0), down + d.min(0));
        if sum + up > i128::from(i64::MAX) || sum + down < i128::from(i64::MIN) {
            return Err(BrokerError::InvalidRequest(format!(
                "adding {delta} would overflow the counter {}",
                crate::error::cut(key)
            )));
        }
        Ok(())
    }

    /// Waits while a compaction holds new adds of the counter `key` back (see
    /// `adds_held`); whether it waited. Called before an add's checks and claim.
    pub async fn add_turn(&self, key: &str) -> bool {
        let mut waited = false;
        loop {
            let held = {
                let h = self.adds_held.borrow();
                !h.is_empty() && h.contains(key)
            };
            if !held {
                return waited;
            }
            waited = true;
            self.changed.changed().await;
        }
    }

    /// Adds `delta` to the counter `key`; resolves when durable per the fsync mode with
    /// the sum including it.
    pub async fn counter_add(
        &self,
        key: &str,
        delta: i64,
        mut now: Now,
    ) -> Result<i64, BrokerError> {
        if self.add_turn(key).await {
            now = felix_core_runtime::clock::now();
        }
        let _adding = self.begin_add(key, delta)?;
        let rec = encode_counter_record(key, delta);
        let pending = self.log.begin_append(&[rec], now.wall_micros, None)?;
        self.writes.set(self.writes.get() + 1);
        let appended = self.log.commit(pending).await?;
        let mut state = self.state.borrow_mut();
        apply(
            &mut state,
            CacheRecord {
                op: RecordOp::Add(delta),
                expires_at_ms: 0,
                key: key.to_owned(),
                value: Bytes::new(),
                carried: None,
            },
            appended.first,
        );
        self.changed.wake_all();
        Ok(state.counters.get(key).copied().unwrap_or(0))
    }

    /// Flushes and closes the log.
    pub async fn close(&self) -> Result<(), BrokerError> {
        Ok(self.log.close().await?)
    }

    /// The log (for health checks and retention).
    pub fn log(&self) -> &SegmentLog<DmaBackend> {
        &self.log
    }
}

/// Where a compaction's records go.
pub trait CompactionWrites {
    /// Appends `records` (claiming their offsets before the first wait) and resolves
    /// once they are durable here: the offset of the first.
    fn append(
        &self,
        records: &[Bytes],
        now_micros: u64,
    ) -> impl std::future::Future<Output = Result<u64, BrokerError>>;

    /// Puts copies `append` wrote at `first` into the index (a replicated leader's
    /// `append` applied them already, in log order with the writes around them).
    fn apply(&self, shard: &CacheShard, first: u64, records: &[Bytes]);

    /// Every copy is written: make the records below `cut` go. Returns the segments
    /// removed now.
    fn finish(
        &self,
        cut: u64,
        now_micros: u64,
    ) -> impl std::future::Future<Output = Result<usize, BrokerError>>;
}

/// A compaction of a cache this broker alone holds: straight to its log; the segments
/// below the cut go as soon as the copies are on disk.
#[derive(Debug)]
pub struct LocalWrites<'a>(pub &'a SegmentLog<DmaBackend>);

impl CompactionWrites for LocalWrites<'_> {
    async fn append(&self, records: &[Bytes], now_micros: u64) -> Result<u64, BrokerError> {
        let pending = self.0.begin_append(records, now_micros, None)?;
        Ok(self.0.commit(pending).await?.first)
    }

    fn apply(&self, shard: &CacheShard, first: u64, records: &[Bytes]) {
        shard.apply_copies(first, records);
    }

    async fn finish(&self, cut: u64, now_micros: u64) -> Result<usize, BrokerError> {
        // The copies are on disk before the segments below the cut go (see
        // `remove_superseded_below`).
        Ok(self
            .0
            .remove_superseded_below(now_micros, Some(0), None, cut)
            .await?)
    }
}

/// The values and counters a cache log describes.
async fn replay(key: &ShardKey, log: &SegmentLog<DmaBackend>) -> Result<Projection, BrokerError> {
    let mut index = Projection::default();
    let mut at = log.base_offset();
    loop {
        let batches: Vec<ReadBatch> = match log.read(at, 4 << 20).await {
            Ok(b) => b,
            // A cut removed what was being read (a replica's compaction cut while it
            // began leading): everything live below the new base was copied past it, so
            // the replay starts over there. It failed, and the new leader never served.
            Err(felix_storage_uring::StorageError::Trimmed { .. }) => {
                index = Projection::default();
                at = log.base_offset();
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if batches.is_empty() {
            break;
        }
        for b in batches {
            if b.kind == BatchKind::Data {
                for (i, r) in b.records.iter().enumerate() {
                    let mut rec = decode_cache_record(r).ok_or_else(|| {
                        BrokerError::Storage(format!(
                            "cache {} offset {}: malformed cache record",
                            key,
                            b.base_offset + i as u64
                        ))
                    })?;
                    // Its own copy: a slice held the read's whole buffer (4 MiB) for
                    // as long as the key lived.
                    rec.value = Bytes::copy_from_slice(&rec.value);
                    apply(&mut index, rec, b.base_offset + i as u64);
                }
            }
            at = b.end_offset();
        }
    }
    index.end = index.end.max(at);
    Ok(index)
}

fn apply(state: &mut Projection, rec: CacheRecord, offset: u64) {
    let before = state.end;
    state.end = state.end.max(offset + 1);
    if let Some(recent) = &mut state.recent {
        recent.note(&rec, offset, before, state.end);
    }
    match rec.op {
        RecordOp::Put => {
            let entry = CacheEntry {
                value: rec.value,
                version: rec.carried.unwrap_or(offset),
                expires_at_ms: rec.expires_at_ms,
                at: offset,
            };
            let before = state.index.get(&rec.key).map_or(0, |e| e.expires_at_ms);
            if before != rec.expires_at_ms {
                if before != 0 {
                    state.expiring.remove(&(before, rec.key.clone()));
                }
                if rec.expires_at_ms != 0 {
                    state.expiring.insert((rec.expires_at_ms, rec.key.clone()));
                }
            }
            state.index.insert(rec.key, entry);
        }
        RecordOp::Delete => {
            if let Some(e) = state.index.remove(&rec.key)
                && e.expires_at_ms != 0
            {
                state.expiring.remove(&(e.expires_at_ms, rec.key));
            }
        }
        RecordOp::Add(delta) => {
            // Wrapping, so every replica folds the same sum; adds are checked against
            // overflow before they are written.
            let sum = state.counters.entry(rec.key).or_insert(0);
            *sum = sum.wrapping_add(delta);
        }
        RecordOp::Set(sum) => {
            state.counters.insert(rec.key, sum);
        }
        RecordOp::Cut(cut) => state.cut_marker = Some((offset, cut)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch larger than a client's frame goes as frames that each fit, back to back,
    /// offsets running on and every record in order: binary (`skipped_before` with the
    /// first only) and JSON (base64, a third larger).
    #[test]
    fn event_batches_larger_than_a_frame_go_as_frames_that_fit() {
        use felix_wire::frame::{DEFAULT_MAX_PAYLOAD_BYTES, FrameReader};
        let records: Vec<Bytes> = (0..5u8).map(|i| Bytes::from(vec![i; 5 << 20])).collect();
        let names = StreamNames {
            tenant: "t".into(),
            namespace: "n".into(),
            stream: "s".into(),
        };
        for json in [false, true] {
            let bytes = if json {
                encode_json_events(&names, 100, &records)
            } else {
                encode_events(100, &records, Some(3))
            };
            let mut reader = FrameReader::new(DEFAULT_MAX_PAYLOAD_BYTES);
            reader.push(bytes);
            let (mut got, mut frames) = (Vec::new(), 0);
            while let Some(f) = reader.next_frame().expect("every frame fits") {
                frames += 1;
                let (base, payloads, skipped) = if json {
                    match Message::decode(&f.payload).unwrap() {
                        Message::EventBatch {
                            base_offset,
                            payloads,
                            ..
                        } => (base_offset.unwrap().0, payloads, None),
                        other => panic!("{other:?}"),
                    }
                } else {
                    let b = EventBatch::decode(f.flags, &f.payload).unwrap();
                    let p = b.events.into_iter().map(|e| e.payload).collect();
                    (b.base_offset.unwrap().0, p, b.skipped_before)
                };
                assert_eq!(base, 100 + got.len() as u64, "offsets run on");
                assert_eq!(skipped.is_some(), !json && got.is_empty(), "skipped first");
                got.extend(payloads);
            }
            assert!(frames > 1, "split (json {json})");
            assert_eq!(got, records, "every record, in order (json {json})");
        }
        // One that fits stays one frame.
        let small = encode_events(7, &records[..1], None);
        let mut reader = FrameReader::new(DEFAULT_MAX_PAYLOAD_BYTES);
        reader.push(small);
        assert!(reader.next_frame().unwrap().is_some());
        assert!(reader.next_frame().unwrap().is_none());
    }

    /// Two adds racing to the edge of i64 cannot both pass: each is checked against the
    /// applied sum and every add in flight (they were checked against the applied sum
    /// alone, and the sum wrapped to a large negative value).
    #[test]
    fn adds_in_flight_count_against_a_counters_overflow() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            shard.counter_add("n", i64::MAX - 10, now).await.unwrap();
            let first = shard.begin_add("n", 6).expect("room for one");
            assert!(
                shard.begin_add("n", 6).is_err(),
                "two adds of 6 in flight would pass i64::MAX - 10"
            );
            let down = shard.begin_add("n", -7).expect("a negative add has room");
            drop(first);
            drop(down);
            assert_eq!(shard.counter_add("n", 6, now).await.unwrap(), i64::MAX - 4);
            assert!(shard.counter_add("n", 6, now).await.is_err());
            // The other edge: the negative adds in flight are what count there.
            shard.counter_add("m", i64::MIN + 10, now).await.unwrap();
            let _low = shard.begin_add("m", -6).unwrap();
            assert!(shard.begin_add("m", -6).is_err());
            assert!(shard.begin_add("m", 100).is_ok());
            // A TTL near u64::MAX is "as long as can be": stored live, never wrapped.
            shard
                .put("forever", Bytes::from_static(b"v"), Some(u64::MAX), now)
                .await
                .unwrap();
            assert!(shard.get("forever", now).is_some());
        });
    }

    /// Two counters added to in turn, one always with an add in flight: a compaction
    /// checkpoints each at a moment it is quiet. (It waited for each of a chunk in
    /// turn and gave up when one had an add in flight again: counters added to all the
    /// time kept every compaction giving up, and the log grew.)
    #[test]
    fn a_compaction_checkpoints_counters_that_are_never_quiet_together() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            shard.counter_add("a", 1, now).await.unwrap();
            shard.counter_add("b", 2, now).await.unwrap();
            let a = shard.begin_add("a", 10).unwrap();
            let writes = Checkpoints {
                inner: LocalWrites(shard.log()),
                shard: &shard,
                taken_busy: std::cell::Cell::new(0),
            };
            let turns = async {
                let settle = || async {
                    for _ in 0..5 {
                        felix_core_runtime::task::yield_now().await;
                    }
                };
                settle().await;
                let b = shard.begin_add("b", 20).unwrap();
                drop(a);
                settle().await;
                let a = shard.begin_add("a", 10).unwrap();
                drop(b);
                settle().await;
                drop(a);
            };
            let (compacted, ()) = futures_lite::future::zip(shard.compact(&writes), turns).await;
            let c = compacted.expect("the compaction finishes");
            assert_eq!(c.counters, 2, "{c:?}");
            assert_eq!(
                writes.taken_busy.get(),
                0,
                "a checkpoint was taken while its counter had an add in flight"
            );
            assert_eq!((shard.counter("a"), shard.counter("b")), (Some(1), Some(2)));
        });
    }

    /// A counter added to without a gap (each add claimed before the one ahead of it
    /// applied, as a pipelining client's are) is checkpointed too: the compaction holds
    /// its new adds back until those in flight land. It waited for a quiet moment that
    /// never came, gave up after 10 s, and every compaction after it did the same: the
    /// cache's log grew for good.
    #[test]
    fn a_compaction_checkpoints_a_counter_added_to_without_a_gap() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let added = std::cell::Cell::new(0i64);
            let done = std::cell::Cell::new(false);
            let add = || async {
                shard
                    .counter_add("c", 1, felix_core_runtime::clock::now())
                    .await
                    .unwrap();
                added.set(added.get() + 1);
            };
            add().await;
            let writes = Checkpoints {
                inner: LocalWrites(shard.log()),
                shard: &shard,
                taken_busy: std::cell::Cell::new(0),
            };
            // One add after another with no wait between: the next is claimed as soon
            // as the one ahead of it is applied, before the compaction looks again.
            let adder = async {
                while !done.get() {
                    add().await;
                }
            };
            let compaction = async {
                while added.get() < 20 {
                    felix_core_runtime::task::sleep(std::time::Duration::from_micros(200)).await;
                }
                let compacted = shard.compact(&writes).await;
                done.set(true);
                compacted
            };
            let (compacted, ()) = futures_lite::future::zip(compaction, adder).await;
            let c = compacted.expect("the compaction finishes");
            assert_eq!(c.counters, 1, "{c:?}");
            assert_eq!(
                writes.taken_busy.get(),
                0,
                "a checkpoint was taken while its counter had an add in flight"
            );
            assert_eq!(shard.counter("c"), Some(added.get()));
            // And the log says so: the checkpoint, then the adds made after it.
            shard.close().await.unwrap();
            let reopened = cache_in(dir.path()).await;
            assert_eq!(reopened.counter("c"), Some(added.get()));
        });
    }

    /// A cache key named like the guard a counter's adds were once tracked under
    /// (`"\0counter\0c"`) is a key like any other: a compaction copies it while an
    /// add of counter `c` is in flight. It waited for that add, and adds always in
    /// flight kept every compaction waiting for good.
    #[test]
    fn a_key_named_like_a_counter_does_not_wait_for_its_adds() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            shard
                .put("\u{0}counter\u{0}c", Bytes::from_static(b"v"), None, now)
                .await
                .unwrap();
            shard.counter_add("c", 1, now).await.unwrap();
            let adding = shard.begin_add("c", 1).unwrap();
            let before = shard.log.next_offset();
            let turns = async {
                for _ in 0..20 {
                    felix_core_runtime::task::yield_now().await;
                }
                let copied = shard.log.next_offset() > before;
                drop(adding);
                copied
            };
            let (c, copied) =
                futures_lite::future::zip(shard.compact(&LocalWrites(shard.log())), turns).await;
            assert!(copied, "the key's copy waited for the counter's add");
            let c = c.expect("the compaction finishes");
            assert_eq!((c.values, c.counters), (1, 1), "{c:?}");
        });
    }

    /// Values expired before a compaction and not yet deleted (expiry writes a bounded
    /// batch a shard a round) get their delete past the cut: after a restart a watcher
    /// resuming from the compaction's cut still sees every one go. Dropped by the compaction,
    /// they left the rebuilt index with no delete ever written.
    #[test]
    fn a_compaction_deletes_the_expired_values_it_does_not_copy() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            for i in 0..300 {
                shard
                    .put(&format!("k{i}"), Bytes::from_static(b"v"), Some(1), now)
                    .await
                    .unwrap();
            }
            shard
                .put("kept", Bytes::from_static(b"v"), None, now)
                .await
                .unwrap();
            let watched_from = shard.applied_end();
            felix_core_runtime::task::sleep(std::time::Duration::from_millis(5)).await;
            let c = shard.compact(&LocalWrites(shard.log())).await.unwrap();
            assert_eq!(c.values, 301, "{c:?}");
            drop(shard);
            let shard = cache_in(dir.path()).await;
            let later = felix_core_runtime::clock::now();
            let changes = shard
                .changes(watched_from, &WatchFilter::Prefix(String::new()), 64 << 20)
                .await
                .unwrap()
                .changes;
            let deleted = changes.iter().filter(|c| c.value.is_none()).count();
            assert_eq!(deleted, 300, "a delete for each expired value");
            assert!(shard.get("kept", later).is_some());
            assert!(shard.expired(later, 1000).is_empty());
        });
    }

    /// Watchers answered from the recent changes get what the log holds: each put and
    /// delete (an expiry's too) by filter, in order, from every position inside the
    /// window, in pages, none of the counters' writes or a compaction's copies; and
    /// nothing is read from the log for them.
    #[test]
    fn watchers_get_from_the_recent_changes_what_the_log_holds() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            shard
                .put("early", Bytes::from_static(b"0"), None, now)
                .await
                .unwrap();
            shard.watch_waiting(std::time::Instant::now());
            let began = shard.applied_end();
            for i in 0..40u64 {
                let key = format!("{}:{}", ["a", "b"][i as usize % 2], i % 5);
                match i % 4 {
                    0 | 1 => {
                        let v = Bytes::from(vec![i as u8; 300]);
                        shard.put(&key, v, None, now).await.unwrap();
                    }
                    2 => {
                        shard.delete(&key, now).await.unwrap();
                    }
                    _ => {
                        shard.counter_add(&key, 1, now).await.unwrap();
                    }
                }
            }
            shard
                .put("short", Bytes::from_static(b"s"), Some(1), now)
                .await
                .unwrap();
            felix_core_runtime::task::sleep(std::time::Duration::from_millis(5)).await;
            let later = felix_core_runtime::clock::now();
            for (k, version) in shard.expired(later, 10) {
                assert!(shard.expire(&k, version, later).await.unwrap());
            }
            let end = shard.applied_end();
            let filters = [
                WatchFilter::Prefix(String::new()),
                WatchFilter::Prefix("a:".into()),
                WatchFilter::Key("b:1".into()),
                WatchFilter::Key("short".into()),
            ];
            // Pages of at most 1000 bytes, so bounded answers are compared too.
            async fn all(
                shard: &CacheShard,
                mut from: u64,
                f: &WatchFilter,
            ) -> (Vec<WatchChange>, bool) {
                let (mut out, mut logged) = (Vec::new(), false);
                while from < shard.applied_end() {
                    let got = shard.changes(from, f, 1000).await.unwrap();
                    logged |= got.from_log;
                    out.extend(got.changes);
                    from = got.next;
                }
                (out, logged)
            }
            let mut recent = Vec::new();
            for from in began..end {
                for f in &filters {
                    let (changes, logged) = all(&shard, from, f).await;
                    assert!(!logged, "from {from}, {f:?}: read from the log");
                    recent.push(changes);
                }
            }
            assert!(
                recent
                    .iter()
                    .any(|c| c.iter().any(|c| c.value.is_none() && c.key == "short")),
                "the expiry's delete is a change"
            );
            drop(shard);
            // The same positions read from the log of the reopened shard.
            let shard = cache_in(dir.path()).await;
            let mut logged = Vec::new();
            for from in began..end {
                for f in &filters {
                    let (changes, read_log) = all(&shard, from, f).await;
                    assert!(read_log || changes.is_empty());
                    logged.push(changes);
                }
            }
            assert_eq!(recent, logged);
            // A compaction's copies are not changes.
            shard.watch_waiting(std::time::Instant::now());
            shard.compact(&LocalWrites(shard.log())).await.unwrap();
            shard
                .put("a:last", Bytes::from_static(b"z"), None, now)
                .await
                .unwrap();
            let (after, read_log) = all(&shard, end, &filters[0]).await;
            assert!(!read_log);
            let keys: Vec<_> = after.iter().map(|c| c.key.as_str()).collect();
            assert_eq!(keys, ["a:last"]);
            // Unwatched for the idle time, the window goes, and a watcher reads the log
            // (the changes applied meanwhile are not missed).
            let t = std::time::Instant::now();
            shard.forget_recent_if_idle(t, RECENT_IDLE);
            assert!(shard.keeps_recent(), "watched just now");
            shard.forget_recent_if_idle(t + RECENT_IDLE, RECENT_IDLE);
            assert!(!shard.keeps_recent());
            shard
                .put("a:gone", Bytes::from_static(b"g"), None, now)
                .await
                .unwrap();
            let (after, read_log) = all(&shard, end, &filters[0]).await;
            assert!(read_log);
            let keys: Vec<_> = after.iter().map(|c| c.key.as_str()).collect();
            assert_eq!(keys, ["a:last", "a:gone"]);
            // A rebuilt index starts without one.
            shard.watch_waiting(std::time::Instant::now());
            shard.rebuild().await.unwrap();
            assert!(!shard.keeps_recent());
        });
    }

    /// A waiting watch is woken by a change it follows (a replicated one once applied),
    /// not by writes of other keys, a counter's add, or a compaction's copies; a rebuild
    /// and a staged write given up wake every one to look again, a release to answer
    /// now; one given up leaves nothing behind.
    #[test]
    fn a_waiting_watch_is_woken_by_the_changes_it_follows_only() {
        use std::task::Poll;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            let (key, prefix) = (
                WatchFilter::Key("x".into()),
                WatchFilter::Prefix("p:".into()),
            );
            let wakes = [crate::wakes::Wakes::new(), crate::wakes::Wakes::new()];
            // Both filters waiting, each polled once with its own waker.
            let wait_both = || {
                let mut waits = [
                    Box::pin(shard.change_followed(&key)),
                    Box::pin(shard.change_followed(&prefix)),
                ];
                for (w, wakes) in waits.iter_mut().zip(&wakes) {
                    assert!(w.as_mut().poll(&mut wakes.cx()).is_pending());
                }
                waits
            };
            let looks_again = |waits: &mut [std::pin::Pin<Box<Woken<'_>>>; 2]| {
                for (w, wakes) in waits.iter_mut().zip(&wakes) {
                    assert_eq!(
                        w.as_mut().poll(&mut wakes.cx()),
                        Poll::Ready(Wake::LookAgain)
                    );
                }
            };
            let woken = || {
                wakes
                    .iter()
                    .map(crate::wakes::Wakes::count)
                    .collect::<Vec<_>>()
            };
            let mut waits = wait_both();
            shard
                .put("y", Bytes::from_static(b"1"), None, now)
                .await
                .unwrap();
            shard
                .put("x:not", Bytes::from_static(b"1"), None, now)
                .await
                .unwrap();
            shard.counter_add("x", 1, now).await.unwrap();
            shard.compact(&LocalWrites(shard.log())).await.unwrap();
            assert_eq!(woken(), [0, 0], "woken by writes they do not follow");
            shard
                .put("x", Bytes::from_static(b"2"), None, now)
                .await
                .unwrap();
            assert_eq!(woken(), [1, 0]);
            shard.delete("p:gone", now).await.unwrap();
            assert_eq!(woken(), [1, 0], "nothing deleted, nothing written");
            shard
                .put("p:1", Bytes::from_static(b"3"), None, now)
                .await
                .unwrap();
            assert_eq!(woken(), [1, 1]);
            looks_again(&mut waits);
            // Waiting again: a rebuild wakes both; a watch given up is forgotten.
            let mut waits = wait_both();
            shard.rebuild().await.unwrap();
            assert_eq!(woken(), [2, 2]);
            looks_again(&mut waits);
            drop(waits);
            // A replicated leader's write: woken as it is applied, once committed, not
            // when staged; a staged write given up wakes every watch to look again; a
            // move's release tells them to answer now.
            let mut wait = Box::pin(shard.change_followed(&key));
            let poll = |w: &mut std::pin::Pin<Box<Woken<'_>>>| w.as_mut().poll(&mut wakes[0].cx());
            assert!(poll(&mut wait).is_pending());
            let at = shard.applied_end();
            let rec = encode_cache_record(true, 0, "x", b"staged");
            shard.stage(at, &rec, std::time::Instant::now());
            assert_eq!(woken()[0], 2, "staged, not applied");
            shard.apply_through(at + 1);
            assert_eq!(woken()[0], 3);
            assert_eq!(poll(&mut wait), Poll::Ready(Wake::LookAgain));
            let mut wait = Box::pin(shard.change_followed(&key));
            assert!(poll(&mut wait).is_pending());
            let sum = shard.stage(at + 1, &rec, std::time::Instant::now());
            shard.unstage(at + 1, &sum);
            assert_eq!(woken()[0], 4);
            assert_eq!(poll(&mut wait), Poll::Ready(Wake::LookAgain));
            let mut wait = Box::pin(shard.change_followed(&key));
            assert!(poll(&mut wait).is_pending());
            shard.release_watches();
            assert_eq!(poll(&mut wait), Poll::Ready(Wake::Released));
            drop(wait);
            let mut given_up = Box::pin(shard.change_followed(&key));
            assert!(poll(&mut given_up).is_pending());
            drop(given_up);
            assert_eq!(shard.watching.borrow().len(), 0);
        });
    }

    /// A compaction copies large values in batches the log takes: 64 values of a
    /// megabyte made one batch over its 64 MiB bound, refused, and every compaction of
    /// the cache failed so, its log growing for good.
    #[test]
    fn a_compaction_of_large_values_batches_them_within_the_logs_bound() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            for i in 0..70u8 {
                let v = Bytes::from(vec![i; 1 << 20]);
                shard.put(&format!("k{i}"), v, None, now).await.unwrap();
            }
            let c = shard.compact(&LocalWrites(shard.log())).await.unwrap();
            assert_eq!(c.values, 70, "{c:?}");
            drop(shard);
            let shard = cache_in(dir.path()).await;
            for i in 0..70u8 {
                let v = shard.get(&format!("k{i}"), now).unwrap().value;
                assert!(v.len() == 1 << 20 && v.iter().all(|b| *b == i), "k{i}");
            }
        });
    }

    /// A compaction looks at each key a bounded number of times while it picks what to
    /// copy: it scanned the index from its start for every batch of 64, some N²/128
    /// looks (10⁹ and more for a cache of a few million keys: tens of seconds of its
    /// core's time, in slices of one whole scan each).
    #[test]
    fn a_compaction_looks_at_each_key_a_bounded_number_of_times() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let config = unsynced();
            let shard = cache_with(dir.path(), config.clone()).await;
            let now = felix_core_runtime::clock::now();
            let keys = 20_000;
            put_keys(&shard, keys, now).await;
            shard.delete("k7", now).await.unwrap();
            let c = shard.compact(&LocalWrites(shard.log())).await.unwrap();
            assert_eq!(c.values, keys - 1, "{c:?}");
            let examined = shard.compact_examined.get();
            assert!(
                examined <= 3 * keys as u64,
                "{examined} looks at keys to copy {keys}"
            );
            drop(shard);
            let shard = cache_with(dir.path(), config).await;
            for i in [0, 6, 8, keys - 1] {
                assert!(shard.get(&format!("k{i}"), now).is_some(), "k{i}");
            }
            assert!(shard.get("k7", now).is_none());
        });
    }

    /// Writes queued on one key (conditional writes racing on a hot key) each look at
    /// the queue about once more when their turn comes, and writes waiting for a key's
    /// writes in flight once more when those are done; neither wakes for writes of
    /// other keys. Woken by every change of the shard, N writes queued on one key took
    /// N² looks, and every waiting write looked again at every write of any key.
    #[test]
    fn waiting_writes_wake_for_their_own_key_only() {
        use std::rc::Rc;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = Rc::new(cache_in(dir.path()).await);
            const QUEUED: usize = 200;
            const SETTLING: usize = 50;
            let done = Rc::new(std::cell::Cell::new(0usize));
            let order = Rc::new(RefCell::new(Vec::new()));
            // Writes of "hot" queued behind a first that holds the front.
            let first = shard.ticket("hot");
            let mut tasks = Vec::new();
            for i in 0..QUEUED {
                let (s, done, order) = (shard.clone(), done.clone(), order.clone());
                // Tasks start in the order spawned: their tickets are taken in it.
                tasks.push(felix_core_runtime::task::spawn(async move {
                    let ticket = s.ticket("hot");
                    ticket.turn().await;
                    order.borrow_mut().push(i);
                    felix_core_runtime::task::yield_now().await;
                    drop(ticket);
                    done.set(done.get() + 1);
                }));
            }
            // Writes waiting for a write in flight of a key of their own.
            let writing: Vec<_> = (0..SETTLING)
                .map(|i| shard.key_write(&format!("settling-{i}")))
                .collect();
            for i in 0..SETTLING {
                let (s, done) = (shard.clone(), done.clone());
                tasks.push(felix_core_runtime::task::spawn(async move {
                    s.key_settled(&format!("settling-{i}")).await;
                    done.set(done.get() + 1);
                }));
            }
            felix_core_runtime::task::yield_now().await;
            let looked = shard.waits_looked.get();
            assert!(
                looked <= (QUEUED + SETTLING) as u64,
                "{looked} looks while all wait"
            );
            // Writes of other keys, each taking and letting go of a place and being in
            // flight a while: no waiting write looks again.
            for i in 0..500 {
                let key = format!("other-{i}");
                let t = shard.ticket(&key);
                drop(shard.key_write(&key));
                drop(t);
                felix_core_runtime::task::yield_now().await;
            }
            let idle = shard.waits_looked.get() - looked;
            assert!(idle <= 5, "{idle} looks for writes of other keys");
            drop(first);
            drop(writing);
            for t in tasks {
                // A lost wake-up fails here rather than hanging the suite.
                felix_core_runtime::task::timeout(std::time::Duration::from_secs(10), t)
                    .await
                    .expect("a waiting write was never woken");
            }
            assert_eq!(done.get(), QUEUED + SETTLING);
            assert_eq!(*order.borrow(), (0..QUEUED).collect::<Vec<_>>(), "in turn");
            let total = shard.waits_looked.get();
            assert!(
                total <= 3 * (QUEUED + SETTLING) as u64,
                "{total} looks for {QUEUED} queued and {SETTLING} settling writes"
            );
        });
    }

    /// What the looks test leaves out: a write giving up its place in the middle of the
    /// queue lets the ones behind it through in order; a key with two writes in flight
    /// settles only once both are done; a write going in flight between a waiter's
    /// wake-up and its look keeps it waiting, and its end wakes it.
    #[test]
    fn waiting_writes_go_on_once_their_key_lets_them() {
        use felix_core_runtime::task::{spawn, timeout, yield_now};
        use std::rc::Rc;
        use std::time::Duration;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = Rc::new(cache_in(dir.path()).await);
            let order = Rc::new(RefCell::new(Vec::new()));
            let first = shard.ticket("k");
            let queued = |i: usize| {
                let (s, order) = (shard.clone(), order.clone());
                spawn(async move {
                    let ticket = s.ticket("k");
                    ticket.turn().await;
                    order.borrow_mut().push(i);
                })
            };
            let (a, b, c) = (queued(0), queued(1), queued(2));
            yield_now().await;
            // The middle one gives up (its client went away): its place goes with it.
            drop(b);
            yield_now().await;
            drop(first);
            for t in [a, c] {
                timeout(Duration::from_secs(10), t)
                    .await
                    .expect("a queued write was never let through");
            }
            assert_eq!(*order.borrow(), [0, 2]);

            let settled = Rc::new(Cell::new(false));
            let (one, two) = (shard.key_write("s"), shard.key_write("s"));
            let waiter = {
                let (s, settled) = (shard.clone(), settled.clone());
                spawn(async move {
                    s.key_settled("s").await;
                    settled.set(true);
                })
            };
            yield_now().await;
            drop(one);
            yield_now().await;
            yield_now().await;
            assert!(!settled.get(), "settled with a write of the key in flight");
            // The last one done and another in flight before the waiter looks again.
            drop(two);
            let three = shard.key_write("s");
            yield_now().await;
            yield_now().await;
            assert!(
                !settled.get(),
                "settled with a newer write of the key in flight"
            );
            drop(three);
            timeout(Duration::from_secs(10), waiter)
                .await
                .expect("a settling write was never woken");
            assert!(settled.get());
        });
    }

    /// A value whose key has a write in flight when the compaction picks is looked at
    /// again once that write is done, and copied: the cut removes what it leaves below.
    #[test]
    fn a_compaction_copies_a_value_once_the_write_in_flight_of_its_key_is_done() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            put_keys(&shard, 200, now).await;
            let writing = shard.key_write("k5");
            let done = async {
                felix_core_runtime::task::sleep(std::time::Duration::from_millis(50)).await;
                drop(writing);
            };
            let (c, ()) =
                futures_lite::future::zip(shard.compact(&LocalWrites(shard.log())), done).await;
            let c = c.unwrap();
            assert_eq!(c.values, 200, "{c:?}");
            drop(shard);
            let shard = cache_in(dir.path()).await;
            for i in 0..200 {
                assert!(shard.get(&format!("k{i}"), now).is_some(), "k{i}");
            }
        });
    }

    /// Values replayed at an open are the index's own, not slices of the buffer the log
    /// was read in (4 MiB a read): a small value held all of it alive.
    #[test]
    fn values_replayed_hold_no_slice_of_the_read_buffer() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            for k in ["a", "b"] {
                shard
                    .put(k, Bytes::from_static(b"small"), None, now)
                    .await
                    .unwrap();
            }
            drop(shard);
            let shard = cache_in(dir.path()).await;
            let st = shard.state.borrow();
            for k in ["a", "b"] {
                let v = &st.index.get(k).unwrap().value;
                assert_eq!(v, &Bytes::from_static(b"small"));
                assert!(v.is_unique(), "{k}: shares its buffer");
            }
        });
    }

    /// A replay whose reads a compaction's cut overtakes (a replica that begins leading
    /// while its copy compacts) starts over at the new base: it failed, and the new
    /// leader never served.
    #[test]
    fn a_replay_overtaken_by_a_cut_starts_over_at_the_new_base() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let config = felix_storage_uring::LogConfig {
                segment_bytes_max: 1 << 20,
                ..felix_storage_uring::LogConfig::default()
            };
            let shard = cache_with(dir.path(), config).await;
            let key = shard.key.clone();
            let now = felix_core_runtime::clock::now();
            // 12 MiB of overwrites of a few keys: more than one replay read.
            for i in 0..3_000u32 {
                let v = Bytes::from(vec![(i % 251) as u8; 4096]);
                shard
                    .put(&format!("k{}", i % 4), v, None, now)
                    .await
                    .unwrap();
            }
            let mut replay = std::pin::pin!(replay(&key, shard.log()));
            assert!(poll_once(&mut replay).await.is_none(), "reading");
            let c = shard.compact(&LocalWrites(shard.log())).await.unwrap();
            assert!(c.segments > 0, "{c:?}");
            let replayed = replay.await.expect("started over at the new base");
            for k in 0..4u32 {
                assert_eq!(
                    replayed
                        .index
                        .get(&format!("k{k}"))
                        .map(|e| e.value.clone()),
                    shard.get(&format!("k{k}"), now).map(|e| e.value),
                    "k{k}"
                );
            }
        });
    }

    /// A compaction's writes that count the checkpoints appended while their counter
    /// had an add in flight (replayed, such a checkpoint would drop the add).
    struct Checkpoints<'a> {
        inner: LocalWrites<'a>,
        shard: &'a CacheShard,
        taken_busy: std::cell::Cell<u32>,
    }

    impl CompactionWrites for Checkpoints<'_> {
        async fn append(&self, records: &[Bytes], now_micros: u64) -> Result<u64, BrokerError> {
            for r in records {
                if let Some(rec) = decode_cache_record(r)
                    && matches!(rec.op, RecordOp::Set(_))
                    && self.shard.adding.borrow().contains_key(&rec.key)
                {
                    self.taken_busy.set(self.taken_busy.get() + 1);
                }
            }
            self.inner.append(records, now_micros).await
        }

        fn apply(&self, shard: &CacheShard, first: u64, records: &[Bytes]) {
            self.inner.apply(shard, first, records);
        }

        async fn finish(&self, cut: u64, now_micros: u64) -> Result<usize, BrokerError> {
            self.inner.finish(cut, now_micros).await
        }
    }

    /// Under `fsync: none` a commit answers at sequencing; a compaction must still have
    /// its copies on disk before it removes the segments they replace.
    #[test]
    fn a_compaction_without_fsync_syncs_its_copies_before_removing_old_segments() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let config = felix_storage_uring::LogConfig {
                fsync: felix_storage_uring::FsyncMode::None,
                segment_bytes_max: 64 * 1024,
                // Long enough that, unsynced, nothing of the copies would be written
                // by the time the old segments go.
                write_linger: std::time::Duration::from_millis(200),
                ..felix_storage_uring::LogConfig::default()
            };
            let shard = cache_with(dir.path(), config).await;
            let now = felix_core_runtime::clock::now();
            shard
                .put("kept", Bytes::from_static(b"written long ago"), None, now)
                .await
                .unwrap();
            for i in 0..1500u32 {
                let v = Bytes::from(i.to_be_bytes().repeat(25));
                shard.put("hot", v, None, now).await.unwrap();
            }
            let c = shard.compact(&LocalWrites(shard.log())).await.unwrap();
            assert!(c.segments > 0, "{c:?}");
            assert!(
                shard.log.durable_end() >= c.cut + (c.values + c.counters) as u64,
                "the copies are durable before the old segments go: {c:?}, durable end {}",
                shard.log.durable_end()
            );
            assert_eq!(
                shard.get("kept", now).unwrap().value,
                Bytes::from_static(b"written long ago")
            );
        });
    }

    /// Puts `k0`..`k{n-1}`, each without a time to live.
    async fn put_keys(shard: &CacheShard, n: usize, now: Now) {
        for i in 0..n {
            shard
                .put(&format!("k{i}"), Bytes::from_static(b"v"), None, now)
                .await
                .unwrap();
        }
    }

    /// A log that acknowledges at sequencing (fast to fill; close it before a reopen).
    fn unsynced() -> felix_storage_uring::LogConfig {
        felix_storage_uring::LogConfig {
            fsync: felix_storage_uring::FsyncMode::None,
            ..Default::default()
        }
    }

    async fn cache_in(dir: &std::path::Path) -> CacheShard {
        cache_with(dir, felix_storage_uring::LogConfig::default()).await
    }

    /// A cache shard `t/ns/c/0` over a log in `dir` with `config`.
    async fn cache_with(
        dir: &std::path::Path,
        config: felix_storage_uring::LogConfig,
    ) -> CacheShard {
        let backend = DmaBackend::open_dir(dir).await.unwrap();
        let (log, _) = SegmentLog::open(backend, config).await.unwrap();
        let key = Arc::new(ShardKey {
            kind: felix_core_runtime::placement::ShardKind::Cache,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "c".into(),
            shard: 0,
        });
        CacheShard::open(key, log).await.unwrap()
    }

    /// A delete of a key whose put is still being written is written after it and
    /// removes its value; it used to find nothing, write nothing, and let the put land
    /// after the acknowledged delete.
    #[test]
    fn a_delete_of_a_key_being_written_removes_what_lands_before_it() {
        use futures_lite::future::poll_once;
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            let mut put = std::pin::pin!(shard.put("k", Bytes::from_static(b"v"), None, now));
            assert!(
                poll_once(&mut put).await.is_none(),
                "the put waits for its write"
            );
            let (deleted, put) = futures_lite::future::zip(shard.delete("k", now), put).await;
            put.unwrap();
            assert_eq!(deleted.unwrap(), Some(Bytes::from_static(b"v")));
            assert!(
                shard.get("k", now).is_none(),
                "the put landed after the delete"
            );
        });
    }

    /// Expiry looks at the values whose time ran out, not at every value each round:
    /// it scanned the whole index every second, milliseconds of its core's time for a
    /// shard of millions of keys. A value written again without a time to live, or
    /// deleted, is no longer among them, after a restart too.
    #[test]
    fn expiry_looks_at_the_expired_values_only() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let config = unsynced();
            let shard = cache_with(dir.path(), config.clone()).await;
            let now = felix_core_runtime::clock::now();
            let later = Now::at(now.instant, now.wall_micros + 2_000_000);
            put_keys(&shard, 5_000, now).await;
            for (k, ttl) in [("t1", 1000), ("t2", 500), ("t3", 1500), ("t4", 60_000)] {
                shard
                    .put(k, Bytes::from_static(b"v"), Some(ttl), now)
                    .await
                    .unwrap();
            }
            // Written again without a time to live, deleted, given a shorter one.
            shard
                .put("t1", Bytes::from_static(b"w"), None, now)
                .await
                .unwrap();
            shard.delete("t2", now).await.unwrap();
            let t3 = shard
                .put("t3", Bytes::from_static(b"w"), Some(1200), now)
                .await
                .unwrap();
            // A value without one written again with one, and one written again with
            // the same.
            let k0 = shard
                .put("k0", Bytes::from_static(b"w"), Some(900), now)
                .await
                .unwrap();
            shard
                .put("t4", Bytes::from_static(b"w"), Some(60_000), now)
                .await
                .unwrap();
            let check = |shard: &CacheShard, reopened: bool| {
                let before = shard.expiry_examined.get();
                assert_eq!(
                    shard.expired(later, 10),
                    vec![("k0".to_owned(), k0), ("t3".to_owned(), t3)],
                    "earliest first"
                );
                assert!(shard.expired(now, 10).is_empty());
                let looked = shard.expiry_examined.get() - before;
                assert!(
                    looked <= 2,
                    "{looked} values looked at (reopened: {reopened})"
                );
            };
            check(&shard, false);
            shard.log().close().await.unwrap();
            drop(shard);
            check(&cache_with(dir.path(), config).await, true);
        });
    }

    /// Expiry writes a delete for the version that expired only: a key written again
    /// between the scan and the delete keeps its new value.
    #[test]
    fn expiry_deletes_the_expired_version_only() {
        felix_core_runtime::task::block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let shard = cache_in(dir.path()).await;
            let now = felix_core_runtime::clock::now();
            let later = Now::at(now.instant, now.wall_micros + 2_000_000);
            let a = shard
                .put("a", Bytes::from_static(b"1"), Some(1000), now)
                .await
                .unwrap();
            let b = shard
                .put("b", Bytes::from_static(b"2"), Some(1000), now)
                .await
                .unwrap();
            shard
                .put("c", Bytes::from_static(b"3"), None, now)
                .await
                .unwrap();
            let mut due = shard.expired(later, 10);
            due.sort();
            assert_eq!(due, vec![("a".to_owned(), a), ("b".to_owned(), b)]);
            // "b" is written again after the scan.
            shard
                .put("b", Bytes::from_static(b"new"), None, later)
                .await
                .unwrap();
            // "a" while a write of it is in flight: passed over at once, not waited for.
            {
                use futures_lite::future::poll_once;
                let mut put =
                    std::pin::pin!(shard.put("a", Bytes::from_static(b"1"), Some(1000), now));
                assert!(poll_once(&mut put).await.is_none(), "the put waits");
                let mut expire = std::pin::pin!(shard.expire("a", a, later));
                assert_eq!(
                    poll_once(&mut expire).await.map(Result::unwrap),
                    Some(false),
                    "expiry waited for a write of the key"
                );
                let again = put.await.unwrap();
                assert_eq!(shard.expired(later, 10), vec![("a".to_owned(), again)]);
                assert!(shard.expire("a", again, later).await.unwrap());
            }
            assert!(!shard.expire("b", b, later).await.unwrap());
            assert_eq!(shard.expired(later, 10), vec![]);
            assert_eq!(
                shard.get("b", later).unwrap().value,
                Bytes::from_static(b"new")
            );
            // The delete is in the log: a replay has no "a" even at the earlier time.
            let end = shard.log.next_offset();
            drop(shard);
            let shard = cache_in(dir.path()).await;
            assert_eq!(shard.log.next_offset(), end);
            assert!(shard.get("a", now).is_none(), "the delete is durable");
            assert!(shard.get("c", now).is_some());
        });
    }

    #[test]
    fn cache_records_round_trip_and_garbage_is_refused() {
        let r = encode_cache_record(true, 42, "k", b"value");
        assert_eq!(
            decode_cache_record(&r),
            Some(CacheRecord {
                op: RecordOp::Put,
                expires_at_ms: 42,
                key: "k".into(),
                value: Bytes::from_static(b"value"),
                carried: None,
            })
        );
        for delta in [0, -1, i64::MIN, i64::MAX] {
            let r = decode_cache_record(&encode_counter_record("hits", delta)).unwrap();
            assert_eq!((r.op, r.key.as_str()), (RecordOp::Add(delta), "hits"));
        }
        // A delete or an add with a value is not ours.
        let mut bad = encode_counter_record("k", 1).to_vec();
        bad.push(0);
        assert_eq!(decode_cache_record(&Bytes::from(bad)), None);
        assert_eq!(decode_cache_record(&Bytes::from_static(&[9, 0, 0])), None);
        assert_eq!(
            decode_cache_record(&Bytes::from_static(&[0; 11])).map(|r| r.key),
            Some(String::new())
        );
    }
}
