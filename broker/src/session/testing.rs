//! Test support for the session's sans-IO pieces: an in-memory [`Directory`], sessions
//! for a test tenant, and [`Harness`], which runs frames through dispatch over in-memory
//! shards the way the driver does over real ones. Used by unit tests and the fuzz target.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use felix_core_runtime::clock::Now;
use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_wire::{Features, Flags, Frame, FrameReader};

use super::Session;
use super::answer;
use super::dispatch::{self, Action, Directory, Forwarded};
use super::outbox::{Answer, Outbox};
use crate::auth::{Claims, Grant, SigningKey, TenantKeys, all_data_perms};
use crate::catalog::{Catalog, CoreCatalog, Entry};
use crate::cluster::{Resolved, Route};
use crate::core::CacheOp;
use crate::error::BrokerError;

/// The test tenant.
pub const TENANT: &str = "t1";

/// Parses one whole frame from `bytes` (panics if it is not exactly one frame).
pub fn parse_frame(bytes: &Bytes) -> Frame {
    let mut r = FrameReader::new(u32::MAX);
    r.push(bytes.clone());
    let f = r
        .next_frame()
        .expect("a valid frame")
        .expect("a whole frame");
    assert_eq!(r.buffered(), 0, "exactly one frame");
    f
}

fn signing() -> &'static (SigningKey, TenantKeys) {
    static KEY: OnceLock<(SigningKey, TenantKeys)> = OnceLock::new();
    KEY.get_or_init(|| {
        let key = SigningKey::generate("k1").expect("a key");
        let mut keys = TenantKeys::default();
        keys.add(TENANT, "k1", key.public_key());
        (key, keys)
    })
}

/// The test tenant's verification keys.
pub fn keys() -> TenantKeys {
    signing().1.clone()
}

/// A token for the test tenant with `perms`, valid from `iat` to `exp` (seconds).
pub fn token(perms: Vec<String>, iat: u64, exp: u64) -> String {
    signing().0.sign(&Claims {
        iss: crate::auth::ISSUER.into(),
        aud: crate::auth::BROKER_AUDIENCE.into(),
        sub: "tester".into(),
        tid: TENANT.into(),
        iat,
        exp,
        nbf: None,
        perms,
        jti: None,
    })
}

/// The grant of a token with `perms`.
pub fn grant(perms: Vec<String>) -> Grant {
    let t = token(perms, 1_000, u32::MAX as u64);
    keys().verify(&t, TENANT, 1_000).expect("a valid token")
}

/// A session with every data permission, every layout and coded errors.
pub fn session() -> Session {
    session_with(all_data_perms(TENANT), Features::ERROR_CODES)
}

/// A session with `perms` and `features`.
pub fn session_with(perms: Vec<String>, features: Features) -> Session {
    Session::new(grant(perms), "token", Flags(0xffff), features)
}

/// A moment of virtual time, `secs` after the epoch.
pub fn at(secs: u64) -> Now {
    Now::at(Instant::now(), secs * 1_000_000)
}

/// An in-memory directory: a catalog (auto-creating with `shards`), and shards another
/// broker leads.
#[derive(Debug)]
pub struct MemDirectory {
    catalog: CoreCatalog,
    /// Shards led elsewhere.
    pub remote: RefCell<HashMap<ShardKey, Route>>,
    /// Shards nobody serves now.
    pub unavailable: RefCell<HashSet<ShardKey>>,
    /// Odd-numbered shards of every stream: led elsewhere (`Some(true)`) or
    /// unavailable (`Some(false)`).
    pub odd_shards: std::cell::Cell<Option<bool>>,
}

impl MemDirectory {
    /// A directory creating streams and caches on first use with `shards` shards.
    pub fn new(shards: u32) -> MemDirectory {
        let catalog = Arc::new(Catalog::open(None, Some(shards)).expect("in memory"));
        MemDirectory {
            catalog: CoreCatalog::new(catalog),
            remote: RefCell::default(),
            unavailable: RefCell::default(),
            odd_shards: std::cell::Cell::new(None),
        }
    }

    /// The catalog behind it.
    pub fn catalog(&self) -> &Arc<Catalog> {
        self.catalog.shared()
    }
}

impl Directory for MemDirectory {
    fn stream(&self, t: &str, ns: &str, s: &str, create: bool) -> Result<Rc<Entry>, BrokerError> {
        self.catalog.stream(t, ns, s, create)
    }

    fn cache(&self, t: &str, ns: &str, c: &str, create: bool) -> Result<Rc<Entry>, BrokerError> {
        self.catalog.cache(t, ns, c, create)
    }

    fn resolve(&self, key: &ShardKey) -> Resolved {
        match self.odd_shards.get() {
            Some(true) if key.shard % 2 == 1 => {
                return Resolved::Remote(Route {
                    leader: "node-x".into(),
                    addr: Some(([127, 0, 0, 1], 5999).into()),
                    generation: 3,
                    replicas: vec!["node-x".into()].into(),
                    learners: Vec::new().into(),
                    handoff_from: None,
                    abandoned: None,
                });
            }
            Some(false) if key.shard % 2 == 1 => {
                return Resolved::Unavailable("owner_unavailable");
            }
            _ => {}
        }
        if self.unavailable.borrow().contains(key) {
            return Resolved::Unavailable("owner_unavailable");
        }
        match self.remote.borrow().get(key) {
            Some(r) => Resolved::Remote(r.clone()),
            None => Resolved::Local,
        }
    }

    fn topology(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    fn owners(&self, _: ShardKind, _: &str, _: &str, _: &str) -> Vec<(u32, Route)> {
        Vec::new()
    }
}

/// Frames through decode and decide, with actions carried out over in-memory shards:
/// appends land in per-shard vectors, caches in maps, forwards are answered as a leader
/// would. Answers are queued in an [`Outbox`] like the driver's and decoded as frames.
#[derive(Debug)]
pub struct Harness {
    /// The directory.
    pub dir: MemDirectory,
    /// The stream's session.
    pub session: Session,
    /// Whether the stream is answered (bidirectional).
    pub answered: bool,
    /// Each shard's records.
    pub logs: HashMap<ShardKey, Vec<Bytes>>,
    /// Each cache shard's values.
    pub caches: HashMap<ShardKey, HashMap<String, Bytes>>,
    /// Subscriptions registered.
    pub subscriptions: Vec<Arc<ShardKey>>,
    /// The stream's answers.
    pub outbox: Outbox,
    /// Frames written to the client.
    pub written: Vec<Bytes>,
    /// Whether the stream ended.
    pub ended: bool,
    /// Virtual time.
    pub now: Now,
    reader: FrameReader,
}

impl Harness {
    /// A harness for `session` over a directory auto-creating 4-shard streams.
    pub fn new(session: Session, answered: bool) -> Harness {
        let mut reader = FrameReader::new(1 << 20);
        reader.set_max_payload_bytes(1 << 20);
        Harness {
            dir: MemDirectory::new(4),
            session,
            answered,
            logs: HashMap::new(),
            caches: HashMap::new(),
            subscriptions: Vec::new(),
            outbox: Outbox::new(256),
            written: Vec::new(),
            ended: false,
            now: at(2_000),
            reader,
        }
    }

    /// Feeds client bytes; every whole frame is dispatched and its action carried out.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.reader.push_slice(bytes);
        while !self.ended {
            let request = match self.reader.next_frame() {
                Ok(Some(frame)) => dispatch::decode(&frame, self.answered),
                Ok(None) => break,
                Err(e) => dispatch::undecodable(&e),
            };
            let action =
                dispatch::decide(&self.session, &self.dir, request, self.answered, self.now);
            self.execute(action);
            self.flush();
        }
    }

    fn push(&mut self, frame: Option<Bytes>) {
        if self.answered {
            self.outbox.push(Answer::Ready(frame));
        }
    }

    fn flush(&mut self) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        while self.outbox.poll_flush(&mut cx, &mut out, 64) == super::outbox::Flush::Write {}
        for f in &out {
            // Every answer is a well-formed frame.
            let _ = parse_frame(f);
        }
        self.written.extend(out);
    }

    fn execute(&mut self, action: Action) {
        match action {
            Action::Answer(f) => self.push(Some(f)),
            Action::Refused(_) => {}
            Action::Close(f) => {
                self.push(f);
                self.ended = true;
            }
            Action::Append {
                key,
                records,
                answer: to,
                ..
            } => {
                let log = self.logs.entry((*key).clone()).or_default();
                let first = log.len() as u64;
                log.extend(records);
                let frame = answer::publish(&self.session, to, Ok(first), None);
                if to.owed() {
                    self.push(frame);
                }
            }
            Action::Forward { route, answer, .. } => match answer {
                Forwarded::Publish(to) if to.owed() => {
                    let frame = answer::publish(
                        &self.session,
                        to,
                        Err(BrokerError::Unacknowledged("no leader in tests".into())),
                        Some(&route),
                    );
                    self.push(frame);
                }
                Forwarded::Publish(_) => {}
                Forwarded::Json | Forwarded::JsonRead => {
                    let f = answer::relay_json(&self.session, Ok(None));
                    self.push(Some(f));
                }
            },
            Action::Query { .. } | Action::CacheWatch { .. } => {
                self.push(None);
            }
            Action::State { request_id, .. } => {
                let frame = felix_wire::Message::CommitOk {
                    request_id,
                    offset: felix_wire::Offset(0),
                };
                self.push(Some(frame.to_frame()));
            }
            Action::Group { request_id, .. } => {
                // The harness serves no groups: an empty poll answer stands for any.
                let frame = felix_wire::Message::GroupRecords {
                    records: Vec::new(),
                    request_id,
                };
                self.push(Some(frame.to_frame()));
            }
            Action::Cache { key, op, .. } => {
                let map = self.caches.entry((*key).clone()).or_default();
                let frame = match op {
                    CacheOp::Get(k) => {
                        let _ = map.get(&k);
                        felix_wire::Message::CacheOk {
                            request_id: Default::default(),
                        }
                    }
                    CacheOp::Put(k, v, _) => {
                        map.insert(k, v);
                        felix_wire::Message::CacheOk {
                            request_id: Default::default(),
                        }
                    }
                    CacheOp::Delete(k) => {
                        map.remove(&k);
                        felix_wire::Message::CacheOk {
                            request_id: Default::default(),
                        }
                    }
                    CacheOp::PutIf(..) | CacheOp::DeleteIf(..) | CacheOp::Expire(..) => {
                        felix_wire::Message::CacheConditionResult {
                            applied: false,
                            version: None,
                            request_id: Default::default(),
                        }
                    }
                    CacheOp::CounterAdd(..) | CacheOp::CounterGet(_) => {
                        felix_wire::Message::CounterValue {
                            value: None,
                            request_id: Default::default(),
                        }
                    }
                }
                .to_frame();
                self.push(Some(frame));
            }
            Action::Subscribe { key, .. } => {
                self.subscriptions.push(key);
                self.push(None);
            }
        }
    }
}

/// The fuzz entry point (`broker/fuzz`, and the corpus replay in `cargo test`): a stream
/// authenticated with every data permission, then arbitrary bytes. The first byte picks
/// the stream's kind (answered or publish-only), the features the client offered, how
/// odd shards resolve, and where the rest is split in two deliveries. Checks: nothing
/// panics, every answer is one well-formed frame, the outbox stays within its window,
/// and the records kept are no more than the bytes given.
pub fn fuzz_session(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut features = Features(0);
    for (bit, f) in [
        (1, Features::ERROR_CODES),
        (2, Features::UNSUPPORTED),
        (3, Features::REDIRECT),
        (4, Features::PUBLISH_PIPELINE),
    ] {
        if mode & (1 << bit) != 0 {
            features = features.union(f);
        }
    }
    let mut h = Harness::new(
        session_with(all_data_perms(TENANT), features),
        mode & 1 == 0,
    );
    h.dir.odd_shards.set(match mode >> 5 & 3 {
        1 => Some(true),
        2 => Some(false),
        _ => None,
    });
    let split = rest
        .first()
        .map_or(0, |b| usize::from(*b) * 7)
        .min(rest.len());
    h.feed(&rest[..split]);
    h.feed(&rest[split..]);
    assert!(h.outbox.unanswered() <= 256);
    let kept: usize = h.logs.values().flatten().map(Bytes::len).sum();
    assert!(kept <= data.len());
}

#[cfg(test)]
mod corpus {
    /// Replays the committed corpus (`broker/fuzz/corpus/session/`), every input and its
    /// first 256 prefixes, through the fuzz entry point.
    #[test]
    fn the_session_fuzz_corpus_replays_clean() {
        let dir = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
        )
        .join("fuzz/corpus/session");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let data = std::fs::read(entry.unwrap().path()).unwrap();
            super::fuzz_session(&data);
            for cut in 0..data.len().min(256) {
                super::fuzz_session(&data[..cut]);
            }
            n += 1;
        }
        assert!(n >= 10, "the corpus has its seeds");
    }
}
