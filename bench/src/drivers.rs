//! One load interface over every broker the bench drives: ours over QUIC (the
//! wire-level client in [`crate::client`]), NATS JetStream and Redis Streams (minimal
//! protocol clients over TCP, written here so each peer is driven as directly as ours).
//!
//! A producer keeps up to `window` batches unacknowledged (pipelined) and reports each
//! batch's ack latency from the time the load *meant* to send it. A consumer yields the
//! send stamps embedded in the first 8 bytes of each record, so end-to-end latency is
//! measured the same way for every broker.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Semaphore;

use crate::client::{Publisher, Subscriber, Target};

/// A boxed future (the traits are used as objects).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = anyhow::Result<T>> + Send + 'a>>;

/// The clock every send stamp is relative to.
pub fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`].
pub fn stamp_now() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Writes `stamp` into the first 8 bytes of a `size`-byte record.
pub fn stamped(size: usize, stamp: u64) -> Bytes {
    let mut b = vec![0x5a; size.max(8)];
    b[..8].copy_from_slice(&stamp.to_be_bytes());
    Bytes::from(b)
}

fn stamp_of(payload: &[u8]) -> u64 {
    payload
        .get(..8)
        .map_or(0, |s| u64::from_be_bytes(s.try_into().expect("8 bytes")))
}

/// A broker under load.
pub trait Driver: Send + Sync {
    /// Its name in tables.
    fn name(&self) -> &'static str;
    /// Creates a stream (idempotent).
    fn create(&self, stream: String) -> BoxFut<'_, ()>;
    /// A producer with `window` batches in flight.
    fn producer(&self, stream: String, window: usize) -> BoxFut<'_, Box<dyn Producer>>;
    /// A consumer of new records.
    fn consumer(&self, stream: String) -> BoxFut<'_, Box<dyn Consumer>>;
    /// Durable flushes so far and the batches they covered, where the broker reports them.
    fn flush_counts(&self) -> Option<(u64, u64)> {
        None
    }
    /// CPU time (ns) the broker's threads have used so far, where it can be read.
    fn server_cpu_ns(&self) -> Option<u64> {
        None
    }
    /// The broker's per-stage latency histograms so far (bucket counts, all cores),
    /// where it keeps them: `(stage, counts)`.
    fn stage_buckets(&self) -> Option<Vec<(&'static str, Vec<u64>)>> {
        None
    }
}

/// The stages [`Driver::stage_buckets`] reports, in the order a publish passes them.
pub const STAGES: [&str; 6] = [
    "mesh hop",
    "claim to commit",
    "device write",
    "fdatasync",
    "received to ack",
    "written to sent",
];

/// The bucket bound (µs) below which `q` of the observations in `counts` fall.
pub fn bucket_quantile(counts: &[u64], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let want = (total as f64 * q).ceil() as u64;
    let mut seen = 0;
    for (i, n) in counts.iter().enumerate() {
        seen += n;
        if seen >= want {
            return Some(
                felix_broker::histogram::BOUNDS_US
                    .get(i)
                    .map_or(f64::INFINITY, |b| *b as f64),
            );
        }
    }
    None
}

/// CPU time (ns) used by the threads of process `pid` (`self` for this one) whose name
/// passes `keep`, from each thread's schedstat, counting threads that have exited since
/// an earlier call with what they had used when last seen (see [`ThreadLedger`]): a sum
/// over the live threads alone falls when one exits (an io_uring worker idles out after
/// a few seconds), and a cell's CPU, taken as the difference of two readings, would then
/// lose everything that thread had used before the cell.
pub fn threads_cpu_ns(pid: &str, keep: impl Fn(&str) -> bool) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut live = Vec::new();
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = task.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        let ns = stat
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0);
        live.push((tid, name.trim().to_owned(), ns));
    }
    let mut ledgers = LEDGERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ledger = ledgers.entry(pid.to_owned()).or_default();
    ledger.observe(&live);
    Some(ledger.total(&keep))
}

/// Every process's [`ThreadLedger`], by the `pid` argument of [`threads_cpu_ns`].
static LEDGERS: std::sync::Mutex<std::collections::BTreeMap<String, ThreadLedger>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// One process's threads as last seen, and those gone since, so that its CPU readings
/// never fall. A thread that exits loses only what it used after it was last seen.
#[derive(Debug, Default)]
pub struct ThreadLedger {
    /// Live at the last reading: tid -> (name, CPU ns).
    seen: std::collections::HashMap<u32, (String, u64)>,
    /// Exited (or whose id was reused by a new thread): name and CPU ns when last seen.
    gone: Vec<(String, u64)>,
}

impl ThreadLedger {
    /// Takes a reading of the live threads: (tid, name, CPU ns).
    pub fn observe(&mut self, live: &[(u32, String, u64)]) {
        let mut next = std::collections::HashMap::with_capacity(live.len());
        for (tid, name, ns) in live {
            if let Some((old_name, old_ns)) = self.seen.remove(tid)
                && (old_name != *name || old_ns > *ns)
            {
                // The id now names another thread.
                self.gone.push((old_name, old_ns));
            }
            next.insert(*tid, (name.clone(), *ns));
        }
        self.gone.extend(self.seen.drain().map(|(_, v)| v));
        self.seen = next;
    }

    /// CPU ns of the threads, live and gone, whose name passes `keep`.
    pub fn total(&self, keep: impl Fn(&str) -> bool) -> u64 {
        self.seen
            .values()
            .chain(&self.gone)
            .filter(|(name, _)| keep(name))
            .map(|(_, ns)| ns)
            .sum()
    }
}

/// Sends batches.
pub trait Producer: Send {
    /// Waits for window room and keeps it for the next `send`: a closed-loop load then
    /// stamps each batch when it can go. (Stamped before, a batch's latency would also
    /// count the wait for the previous ack: twice the round trip one at a time.)
    fn room(&mut self) -> BoxFut<'_, ()>;
    /// Sends one batch once window room frees; `intended` is when the load meant to.
    fn send<'a>(&'a mut self, payloads: &'a [Bytes], intended: Instant) -> BoxFut<'a, ()>;
    /// Waits for every ack; per-batch ack latencies in µs.
    fn finish(self: Box<Self>) -> BoxFut<'static, Vec<f64>>;
}

/// Receives records.
pub trait Consumer: Send {
    /// The send stamps of the next records delivered; `None` when the feed ends.
    fn next(&mut self) -> BoxFut<'_, Option<Vec<u64>>>;
}

// ---- Ours ----------------------------------------------------------------------------

/// Our broker, over QUIC.
#[derive(Debug, Clone)]
pub struct FelixDriver {
    /// How to reach it.
    pub target: Target,
    /// What its process reports, when the bench started it.
    pub broker: Option<Arc<crate::broker::BrokerLink>>,
}

struct FelixProducer {
    target: Target,
    stream: String,
    publisher: Publisher,
    _conn: (quinn::Endpoint, quinn::Connection),
}

struct FelixConsumer {
    sub: Subscriber,
    _conn: (quinn::Endpoint, quinn::Connection),
}

impl Driver for FelixDriver {
    fn name(&self) -> &'static str {
        "felix"
    }

    fn create(&self, _stream: String) -> BoxFut<'_, ()> {
        // The dev broker creates streams on first use.
        Box::pin(async { Ok(()) })
    }

    fn server_cpu_ns(&self) -> Option<u64> {
        self.broker.as_ref()?.cpu_ns()
    }

    fn stage_buckets(&self) -> Option<Vec<(&'static str, Vec<u64>)>> {
        let stages = self.broker.as_ref()?.stage_buckets()?;
        Some(STAGES.iter().copied().zip(stages).collect())
    }

    fn flush_counts(&self) -> Option<(u64, u64)> {
        self.broker.as_ref()?.flush_counts()
    }

    fn producer(&self, stream: String, window: usize) -> BoxFut<'_, Box<dyn Producer>> {
        Box::pin(async move {
            let (ep, conn) = self.target.connect().await?;
            let publisher = Publisher::open(&self.target, &conn, window).await?;
            Ok(Box::new(FelixProducer {
                target: self.target.clone(),
                stream,
                publisher,
                _conn: (ep, conn),
            }) as Box<dyn Producer>)
        })
    }

    fn consumer(&self, stream: String) -> BoxFut<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            let (ep, conn) = self.target.connect().await?;
            let sub = Subscriber::open(&self.target, &conn, "default", &stream).await?;
            Ok(Box::new(FelixConsumer {
                sub,
                _conn: (ep, conn),
            }) as Box<dyn Consumer>)
        })
    }
}

impl Producer for FelixProducer {
    fn room(&mut self) -> BoxFut<'_, ()> {
        Box::pin(async move { self.publisher.reserve().await })
    }

    fn send<'a>(&'a mut self, payloads: &'a [Bytes], intended: Instant) -> BoxFut<'a, ()> {
        Box::pin(async move {
            self.publisher
                .publish_at(
                    &self.target,
                    "default",
                    &self.stream,
                    payloads,
                    Some(intended),
                )
                .await
        })
    }

    fn finish(self: Box<Self>) -> BoxFut<'static, Vec<f64>> {
        Box::pin(async move {
            let FelixProducer {
                publisher, _conn, ..
            } = *self;
            let lat = publisher.finish().await?;
            drop(_conn);
            Ok(lat)
        })
    }
}

impl Consumer for FelixConsumer {
    fn next(&mut self) -> BoxFut<'_, Option<Vec<u64>>> {
        Box::pin(async move {
            Ok(self
                .sub
                .next()
                .await?
                .map(|(_, recs)| recs.iter().map(|r| stamp_of(r)).collect()))
        })
    }
}

// ---- Shared by the TCP peers -----------------------------------------------------------

/// Batches sent and not yet acknowledged, oldest first: (intended time, acks still owed).
type Owed = Arc<Mutex<VecDeque<(Instant, usize)>>>;

/// Counts one ack against the oldest batch; returns its latency when it completes.
fn ack_one(owed: &Owed) -> Option<f64> {
    let mut q = owed.lock().expect("owed acks");
    let front = q.front_mut()?;
    front.1 -= 1;
    if front.1 == 0 {
        let (t, _) = q.pop_front().expect("front exists");
        return Some(t.elapsed().as_secs_f64() * 1e6);
    }
    None
}

/// What a TCP producer's ack reader shares with it.
#[derive(Default)]
struct AckState {
    owed: Owed,
    latencies: Mutex<Vec<f64>>,
    progress: tokio::sync::Notify,
}

impl AckState {
    /// Counts one ack; frees a window slot when a batch completes.
    fn ack(&self, window: &Semaphore) {
        if let Some(l) = ack_one(&self.owed) {
            self.latencies.lock().expect("latencies").push(l);
            window.add_permits(1);
            self.progress.notify_waiters();
        }
    }
}

struct TcpProducer {
    write: OwnedWriteHalf,
    state: Arc<AckState>,
    window: Arc<Semaphore>,
    acks: tokio::task::JoinHandle<anyhow::Result<()>>,
    buf: BytesMut,
    encode: fn(&mut BytesMut, &str, &Bytes),
    /// What `encode` is given: the stream (NATS: its subject and the reply inbox).
    stream: String,
    /// A window slot taken by `room` for the next send.
    reserved: bool,
}

/// Longest a producer waits for its last acks before calling the run lost.
const ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl Producer for TcpProducer {
    fn room(&mut self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            if !self.reserved {
                self.window.acquire().await?.forget();
                self.reserved = true;
            }
            Ok(())
        })
    }

    fn send<'a>(&'a mut self, payloads: &'a [Bytes], intended: Instant) -> BoxFut<'a, ()> {
        Box::pin(async move {
            if !std::mem::take(&mut self.reserved) {
                self.window.acquire().await?.forget();
            }
            self.buf.clear();
            for p in payloads {
                (self.encode)(&mut self.buf, &self.stream, p);
            }
            self.state
                .owed
                .lock()
                .expect("owed acks")
                .push_back((intended, payloads.len()));
            self.write.write_all(&self.buf).await?;
            Ok(())
        })
    }

    fn finish(self: Box<Self>) -> BoxFut<'static, Vec<f64>> {
        Box::pin(async move {
            let TcpProducer {
                write, state, acks, ..
            } = *self;
            let deadline = Instant::now() + ACK_TIMEOUT;
            loop {
                let owed = state.owed.lock().expect("owed acks").len();
                if owed == 0 {
                    break;
                }
                if acks.is_finished() {
                    acks.await??;
                    bail!("the connection ended with {owed} batches unacknowledged");
                }
                if Instant::now() > deadline {
                    bail!("{owed} batches unacknowledged after {ACK_TIMEOUT:?}");
                }
                let _ = tokio::time::timeout(
                    std::time::Duration::from_millis(20),
                    state.progress.notified(),
                )
                .await;
            }
            acks.abort();
            drop(write);
            Ok(std::mem::take(
                &mut *state.latencies.lock().expect("latencies"),
            ))
        })
    }
}

// ---- NATS JetStream --------------------------------------------------------------------

/// NATS JetStream (file storage, one replica).
#[derive(Debug, Clone)]
pub struct NatsDriver {
    /// Server address.
    pub addr: SocketAddr,
    /// Its process, for CPU accounting.
    pub pid: Option<u32>,
}

pub(crate) enum NatsMsg {
    Msg {
        payload: Bytes,
        reply: Option<String>,
    },
    Ping,
    Err(String),
    Other,
}

pub(crate) async fn nats_read(
    r: &mut BufReader<OwnedReadHalf>,
    line: &mut String,
) -> anyhow::Result<Option<NatsMsg>> {
    line.clear();
    if r.read_line(line).await? == 0 {
        return Ok(None);
    }
    let l = line.trim_end();
    let mut parts = l.split_whitespace();
    let op = parts.next().unwrap_or("");
    match op {
        "MSG" | "HMSG" => {
            let fields: Vec<&str> = parts.collect();
            let total: usize = fields.last().context("MSG without size")?.parse()?;
            let headers: usize = if op == "HMSG" {
                fields[fields.len() - 2].parse()?
            } else {
                0
            };
            let mut buf = vec![0u8; total + 2];
            r.read_exact(&mut buf).await?;
            buf.truncate(total);
            let payload = Bytes::from(buf).slice(headers..);
            // MSG <subject> <sid> [reply] <size>; HMSG adds the header size.
            let fixed = if op == "HMSG" { 4 } else { 3 };
            let reply = (fields.len() > fixed).then(|| fields[2].to_owned());
            Ok(Some(NatsMsg::Msg { payload, reply }))
        }
        "PING" => Ok(Some(NatsMsg::Ping)),
        "-ERR" => Ok(Some(NatsMsg::Err(l.to_owned()))),
        _ => Ok(Some(NatsMsg::Other)),
    }
}

pub(crate) async fn nats_connect(
    addr: SocketAddr,
) -> anyhow::Result<(BufReader<OwnedReadHalf>, OwnedWriteHalf)> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (r, mut w) = s.into_split();
    let mut r = BufReader::with_capacity(1 << 20, r);
    let mut line = String::new();
    r.read_line(&mut line).await?; // INFO
    w.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":true}\r\nPING\r\n")
        .await?;
    loop {
        match nats_read(&mut r, &mut line).await? {
            Some(NatsMsg::Other) if line.starts_with("PONG") => return Ok((r, w)),
            Some(NatsMsg::Err(e)) => bail!("nats: {e}"),
            Some(_) => {}
            None => bail!("nats closed the connection"),
        }
    }
}

/// One JetStream API request.
pub(crate) async fn nats_request(
    addr: SocketAddr,
    subject: &str,
    body: &str,
) -> anyhow::Result<serde_json::Value> {
    let (mut r, mut w) = nats_connect(addr).await?;
    w.write_all(
        format!(
            "SUB _INBOX.api 1\r\nPUB {subject} _INBOX.api {}\r\n{body}\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .await?;
    let mut line = String::new();
    loop {
        match nats_read(&mut r, &mut line).await? {
            Some(NatsMsg::Msg { payload, .. }) => {
                let v: serde_json::Value = serde_json::from_slice(&payload)?;
                if let Some(e) = v.get("error") {
                    bail!("nats {subject}: {e}");
                }
                return Ok(v);
            }
            Some(NatsMsg::Ping) => w.write_all(b"PONG\r\n").await?,
            Some(NatsMsg::Err(e)) => bail!("nats {subject}: {e}"),
            Some(NatsMsg::Other) => {}
            None => bail!("nats closed the connection"),
        }
    }
}

/// `target` is the subject and the producer's own reply inbox (`"{subject} {inbox}"`).
fn nats_pub(buf: &mut BytesMut, target: &str, payload: &Bytes) {
    buf.extend_from_slice(format!("PUB {target} {}\r\n", payload.len()).as_bytes());
    buf.extend_from_slice(payload);
    buf.extend_from_slice(b"\r\n");
}

struct NatsConsumer {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
    line: String,
}

static NEXT_CONSUMER: AtomicU64 = AtomicU64::new(1);

static NEXT_PRODUCER: AtomicU64 = AtomicU64::new(1);

impl Driver for NatsDriver {
    fn name(&self) -> &'static str {
        "nats-jetstream"
    }

    fn server_cpu_ns(&self) -> Option<u64> {
        threads_cpu_ns(&self.pid?.to_string(), |_| true)
    }

    fn create(&self, stream: String) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let body = serde_json::json!({
                "name": stream, "subjects": [stream], "storage": "file",
                "retention": "limits", "discard": "old", "num_replicas": 1,
            });
            nats_request(
                self.addr,
                &format!("$JS.API.STREAM.CREATE.{stream}"),
                &body.to_string(),
            )
            .await?;
            Ok(())
        })
    }

    fn producer(&self, stream: String, window: usize) -> BoxFut<'_, Box<dyn Producer>> {
        Box::pin(async move {
            let (mut r, mut w) = nats_connect(self.addr).await?;
            // An inbox of its own: with one shared by every producer, each connection
            // got every producer's PubAcks and counted them as its own (S8's 64
            // producers finished ahead of their own acks).
            let inbox = format!(
                "_INBOX.ack.{}",
                NEXT_PRODUCER.fetch_add(1, Ordering::Relaxed)
            );
            w.write_all(format!("SUB {inbox} 1\r\n").as_bytes()).await?;
            let state = Arc::new(AckState::default());
            let window = Arc::new(Semaphore::new(window));
            let (st, win) = (state.clone(), window.clone());
            let acks = tokio::spawn(async move {
                let mut line = String::new();
                loop {
                    match nats_read(&mut r, &mut line).await? {
                        Some(NatsMsg::Msg { payload, .. }) => {
                            if payload.windows(7).any(|w| w == b"\"error\"") {
                                bail!("nats publish failed: {}", String::from_utf8_lossy(&payload));
                            }
                            st.ack(&win);
                        }
                        Some(NatsMsg::Err(e)) => bail!("nats: {e}"),
                        None => return Ok(()),
                        _ => {}
                    }
                }
            });
            Ok(Box::new(TcpProducer {
                write: w,
                state,
                window,
                acks,
                buf: BytesMut::with_capacity(1 << 20),
                encode: nats_pub,
                stream: format!("{stream} {inbox}"),
                reserved: false,
            }) as Box<dyn Producer>)
        })
    }

    fn consumer(&self, stream: String) -> BoxFut<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            let n = NEXT_CONSUMER.fetch_add(1, Ordering::Relaxed);
            let deliver = format!("deliver.{stream}.{n}");
            let (r, mut w) = nats_connect(self.addr).await?;
            w.write_all(format!("SUB {deliver} 1\r\nPING\r\n").as_bytes())
                .await?;
            let body = serde_json::json!({
                "stream_name": stream,
                "config": {
                    "deliver_subject": deliver, "deliver_policy": "new",
                    "ack_policy": "none", "replay_policy": "instant",
                    "max_ack_pending": -1,
                },
            });
            nats_request(
                self.addr,
                &format!("$JS.API.CONSUMER.CREATE.{stream}"),
                &body.to_string(),
            )
            .await?;
            Ok(Box::new(NatsConsumer {
                r,
                w,
                line: String::new(),
            }) as Box<dyn Consumer>)
        })
    }
}

impl Consumer for NatsConsumer {
    fn next(&mut self) -> BoxFut<'_, Option<Vec<u64>>> {
        Box::pin(async move {
            loop {
                match nats_read(&mut self.r, &mut self.line).await? {
                    Some(NatsMsg::Msg { payload, .. }) => {
                        return Ok(Some(vec![stamp_of(&payload)]));
                    }
                    Some(NatsMsg::Ping) => self.w.write_all(b"PONG\r\n").await?,
                    Some(NatsMsg::Err(e)) => bail!("nats: {e}"),
                    Some(NatsMsg::Other) => {}
                    None => return Ok(None),
                }
            }
        })
    }
}

// ---- Redis Streams ---------------------------------------------------------------------

/// Redis Streams (XADD / XREAD BLOCK).
#[derive(Debug, Clone)]
pub struct RedisDriver {
    /// Server address.
    pub addr: SocketAddr,
    /// Its process, for CPU accounting.
    pub pid: Option<u32>,
}

/// A RESP value (only what XADD and XREAD answer).
#[derive(Debug)]
pub(crate) enum Resp {
    Simple,
    Error(String),
    Int,
    Bulk(Option<Bytes>),
    Array(Option<Vec<Resp>>),
}

pub(crate) fn read_resp<'a>(
    r: &'a mut BufReader<OwnedReadHalf>,
    line: &'a mut String,
) -> Pin<Box<dyn Future<Output = anyhow::Result<Option<Resp>>> + Send + 'a>> {
    Box::pin(async move {
        line.clear();
        if r.read_line(line).await? == 0 {
            return Ok(None);
        }
        let l = line.trim_end().to_owned();
        let (t, rest) = l.split_at(1);
        Ok(Some(match t {
            "+" => Resp::Simple,
            "-" => Resp::Error(rest.to_owned()),
            ":" => Resp::Int,
            "$" => {
                let n: i64 = rest.parse()?;
                if n < 0 {
                    Resp::Bulk(None)
                } else {
                    let mut buf = vec![0u8; n as usize + 2];
                    r.read_exact(&mut buf).await?;
                    buf.truncate(n as usize);
                    Resp::Bulk(Some(Bytes::from(buf)))
                }
            }
            "*" => {
                let n: i64 = rest.parse()?;
                if n < 0 {
                    Resp::Array(None)
                } else {
                    let mut items = Vec::with_capacity(n as usize);
                    for _ in 0..n {
                        items.push(read_resp(r, line).await?.context("array cut short")?);
                    }
                    Resp::Array(Some(items))
                }
            }
            other => bail!("unexpected RESP type {other:?}"),
        }))
    })
}

pub(crate) fn resp_command(buf: &mut BytesMut, args: &[&[u8]]) {
    buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        buf.extend_from_slice(a);
        buf.extend_from_slice(b"\r\n");
    }
}

fn redis_xadd(buf: &mut BytesMut, stream: &str, payload: &Bytes) {
    resp_command(buf, &[b"XADD", stream.as_bytes(), b"*", b"d", payload]);
}

struct RedisConsumer {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
    stream: String,
    last_id: String,
    line: String,
    buf: BytesMut,
}

impl Driver for RedisDriver {
    fn name(&self) -> &'static str {
        "redis-streams"
    }

    fn server_cpu_ns(&self) -> Option<u64> {
        threads_cpu_ns(&self.pid?.to_string(), |_| true)
    }

    fn create(&self, _stream: String) -> BoxFut<'_, ()> {
        // XADD creates the stream.
        Box::pin(async { Ok(()) })
    }

    fn producer(&self, stream: String, window: usize) -> BoxFut<'_, Box<dyn Producer>> {
        Box::pin(async move {
            let s = TcpStream::connect(self.addr).await?;
            s.set_nodelay(true)?;
            let (r, w) = s.into_split();
            let mut r = BufReader::with_capacity(1 << 20, r);
            let state = Arc::new(AckState::default());
            let window = Arc::new(Semaphore::new(window));
            let (st, win) = (state.clone(), window.clone());
            let acks = tokio::spawn(async move {
                let mut line = String::new();
                while let Some(v) = read_resp(&mut r, &mut line).await? {
                    if let Resp::Error(e) = v {
                        bail!("redis XADD failed: {e}");
                    }
                    st.ack(&win);
                }
                Ok(())
            });
            Ok(Box::new(TcpProducer {
                write: w,
                state,
                window,
                acks,
                buf: BytesMut::with_capacity(1 << 20),
                encode: redis_xadd,
                stream,
                reserved: false,
            }) as Box<dyn Producer>)
        })
    }

    fn consumer(&self, stream: String) -> BoxFut<'_, Box<dyn Consumer>> {
        Box::pin(async move {
            let s = TcpStream::connect(self.addr).await?;
            s.set_nodelay(true)?;
            let (r, w) = s.into_split();
            Ok(Box::new(RedisConsumer {
                r: BufReader::with_capacity(1 << 20, r),
                w,
                stream,
                // Consumers open before the producers start: read from the beginning.
                last_id: "0-0".into(),
                line: String::new(),
                buf: BytesMut::new(),
            }) as Box<dyn Consumer>)
        })
    }
}

impl Consumer for RedisConsumer {
    fn next(&mut self) -> BoxFut<'_, Option<Vec<u64>>> {
        Box::pin(async move {
            loop {
                self.buf.clear();
                resp_command(
                    &mut self.buf,
                    &[
                        b"XREAD",
                        b"COUNT",
                        b"4096",
                        b"BLOCK",
                        b"1000",
                        b"STREAMS",
                        self.stream.as_bytes(),
                        self.last_id.as_bytes(),
                    ],
                );
                self.w.write_all(&self.buf).await?;
                let Some(v) = read_resp(&mut self.r, &mut self.line).await? else {
                    return Ok(None);
                };
                // [[stream, [[id, [field, value]], ...]]] or nil on timeout.
                let Resp::Array(Some(streams)) = v else {
                    if let Resp::Error(e) = v {
                        bail!("redis XREAD: {e}");
                    }
                    continue;
                };
                let mut stamps = Vec::new();
                for s in streams {
                    let Resp::Array(Some(mut pair)) = s else {
                        continue;
                    };
                    let Some(Resp::Array(Some(entries))) = pair.pop() else {
                        continue;
                    };
                    for e in entries {
                        let Resp::Array(Some(mut entry)) = e else {
                            continue;
                        };
                        if let Some(Resp::Array(Some(fields))) = entry.pop()
                            && let Some(Resp::Bulk(Some(value))) = fields.into_iter().nth(1)
                        {
                            stamps.push(stamp_of(&value));
                        }
                        if let Some(Resp::Bulk(Some(id))) = entry.pop() {
                            self.last_id = String::from_utf8_lossy(&id).into_owned();
                        }
                    }
                }
                if !stamps.is_empty() {
                    return Ok(Some(stamps));
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::ThreadLedger;

    fn live(threads: &[(u32, &str, u64)]) -> Vec<(u32, String, u64)> {
        threads
            .iter()
            .map(|(tid, name, ns)| (*tid, (*name).to_owned(), *ns))
            .collect()
    }

    /// Readings never fall: a thread that exits (an idle io_uring worker) keeps what it
    /// used, and a thread id reused by a new thread starts the new one from zero.
    #[test]
    fn a_processs_cpu_readings_keep_the_threads_that_exited() {
        let mut l = ThreadLedger::default();
        l.observe(&live(&[(1, "felix-core-0-1", 100), (2, "iou-wrk-1", 50)]));
        assert_eq!(l.total(|_| true), 150);
        // The worker exits; the core goes on.
        l.observe(&live(&[(1, "felix-core-0-1", 130)]));
        assert_eq!(l.total(|_| true), 180, "the worker's 50 ns still count");
        assert_eq!(l.total(|n| n.starts_with("felix-core")), 130);
        // Its id comes back as another thread.
        l.observe(&live(&[(1, "felix-core-0-1", 140), (2, "iou-wrk-1", 5)]));
        assert_eq!(l.total(|_| true), 195);
        l.observe(&live(&[(1, "felix-core-0-1", 140), (2, "felix-http", 7)]));
        assert_eq!(l.total(|_| true), 202);
    }
}
