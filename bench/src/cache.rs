//! `felix-bench cache`: caches and counters, side by side with Redis, both durable (our
//! on-commit fsync, Redis `appendfsync always`: each syncs a write before it answers
//! it), in one run on one machine.
//!
//! Cells, each on one connection with `window` requests in flight (a sliding window:
//! a new request goes out as each answer comes back):
//! - `put`: 1 KiB values over 1,000 keys (ours `cache_put`, Redis `SET`);
//! - `get`: the same keys read back (ours `cache_get`, Redis `GET`);
//! - `incr`: +1 on 16 counters (ours `counter_add`, Redis `INCRBY`).
//!
//! Each cell reports operations per second, the answer latency of each request (sent →
//! answered, µs, p50 and p99) and the server's CPU per operation (µs; ours: the core
//! threads and their io_uring workers, Redis: its process), and checks what it was
//! answered: a get returns the value put, the counters end at exactly the adds sent.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::{Bytes, BytesMut};
use felix_wire::flags::FrameKind;
use felix_wire::{FrameReader, Message, RequestId};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use crate::broker::LocalBroker;
use crate::client::Target;
use crate::compare::Peer;
use crate::drivers::{
    Driver, FelixDriver, Resp, STAGES, bucket_quantile, read_resp, resp_command, threads_cpu_ns,
};
use crate::peers::{self, PeerBinaries};
use crate::stats::percentile;

/// What a cell does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Durable 1 KiB puts.
    Put,
    /// Reads of the values put.
    Get,
    /// Durable +1 on a counter.
    Incr,
}

const KEYS: usize = 1000;
const COUNTERS: usize = 16;
const VALUE_BYTES: usize = 1024;

/// One cell's result.
#[derive(Debug, Clone)]
pub struct CacheCell {
    /// Operations answered per second.
    pub rate: f64,
    /// Answer latency, µs.
    pub p50_us: f64,
    /// Answer latency, µs.
    pub p99_us: f64,
    /// Server CPU per operation, µs.
    pub cpu_us: Option<f64>,
    /// Ours: each stage's p50 and p99 (µs, bucket bounds) over the cell.
    pub stages: Vec<(&'static str, f64, f64)>,
    /// Ours: UDP datagrams per operation the client sent and received (its QUIC
    /// connection's counts): a standalone ACK shows up here as more than one a request.
    pub datagrams: Option<(f64, f64)>,
}

/// Runs every cell for `peers` with each window; prints a table and, per cell, ours
/// against Redis. `ops`: operations per cell; `cores`: our broker's; `cross_core`: our
/// connection is opened again until it lands on a core other than the cache shard's
/// (the case load following moves the shard for). Medians of `rounds`.
pub fn run(
    peers: &[Peer],
    windows: &[usize],
    ops: usize,
    rounds: usize,
    cores: &str,
    cross_core: bool,
) -> anyhow::Result<String> {
    anyhow::ensure!(
        !peers.contains(&Peer::Nats),
        "the cache cells compare with Redis only (NATS has no comparable cache)"
    );
    let bins = if peers.contains(&Peer::Redis) {
        Some(PeerBinaries::install()?)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    type Key = (Peer, Op, usize);
    let mut cells: Vec<(Key, Vec<CacheCell>)> = Vec::new();
    for round in 0..rounds.max(1) {
        eprintln!("round {} of {}", round + 1, rounds.max(1));
        for &peer in peers {
            let results = rt.block_on(one_server(
                peer,
                windows,
                ops,
                cores,
                cross_core,
                bins.as_ref(),
            ))?;
            for (op, window, cell) in results {
                eprintln!(
                    "  {peer:?} {op:?} window {window}: {:.0} ops/s, p50 {:.0} µs p99 {:.0} µs, cpu {} µs/op",
                    cell.rate,
                    cell.p50_us,
                    cell.p99_us,
                    cell.cpu_us.map_or("?".into(), |c| format!("{c:.1}"))
                );
                if let Some((sent, received)) = cell.datagrams {
                    eprintln!(
                        "    client datagrams per op: sent {sent:.2}, received {received:.2}"
                    );
                }
                for (name, p50, p99) in &cell.stages {
                    eprintln!("    {name}: p50 ≤{p50:.0} µs, p99 ≤{p99:.0} µs");
                }
                let key = (peer, op, window);
                match cells.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(cell),
                    None => cells.push((key, vec![cell])),
                }
            }
        }
    }
    let median = |v: &[CacheCell], f: fn(&CacheCell) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).filter(|x| x.is_finite()).collect();
        if x.is_empty() {
            return f64::NAN;
        }
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let mut md = String::from(
        "| broker | op | window | ops/s | p50 µs | p99 µs | server CPU µs/op |\n|---|---|---|---|---|---|---|\n",
    );
    for ((peer, op, window), v) in &cells {
        md += &format!(
            "| {peer:?} | {op:?} | {window} | {:.0} | {:.0} | {:.0} | {:.1} |\n",
            median(v, |c| c.rate),
            median(v, |c| c.p50_us),
            median(v, |c| c.p99_us),
            median(v, |c| c.cpu_us.unwrap_or(f64::NAN)),
        );
    }
    let ours: Vec<_> = cells
        .iter()
        .filter(|((p, _, _), _)| *p == Peer::Felix)
        .collect();
    if ours
        .iter()
        .any(|(_, v)| v.iter().any(|c| !c.stages.is_empty()))
    {
        md += "\nOur stages, p50 / p99 µs (bucket bounds; median round):\n\n| op | window |";
        for name in STAGES {
            md += &format!(" {name} |");
        }
        md += "\n|---|---|";
        md += &"---|".repeat(STAGES.len());
        for ((_, op, window), v) in &ours {
            md += &format!("\n| {op:?} | {window} |");
            for name in STAGES {
                let pick = |q: usize| {
                    let mut x: Vec<f64> = v
                        .iter()
                        .filter_map(|c| c.stages.iter().find(|s| s.0 == name))
                        .map(|s| if q == 0 { s.1 } else { s.2 })
                        .collect();
                    x.sort_by(f64::total_cmp);
                    x.get(x.len() / 2).copied()
                };
                md += &match (pick(0), pick(1)) {
                    (Some(a), Some(b)) => format!(" {a:.0} / {b:.0} |"),
                    _ => " - |".into(),
                };
            }
        }
        md += "\n";
    }
    md += "\nours / Redis (target: get p99 at most Redis's; durable put and increment at least 3x Redis's ops/s):\n";
    for &op in &[Op::Put, Op::Get, Op::Incr] {
        for &window in windows {
            let of = |p: Peer| {
                cells
                    .iter()
                    .find(|(k, _)| *k == (p, op, window))
                    .map(|(_, v)| v.as_slice())
            };
            let (Some(ours), Some(redis)) = (of(Peer::Felix), of(Peer::Redis)) else {
                continue;
            };
            let rate = median(ours, |c| c.rate) / median(redis, |c| c.rate);
            let p99 = median(ours, |c| c.p99_us) / median(redis, |c| c.p99_us);
            let cpu = median(ours, |c| c.cpu_us.unwrap_or(f64::NAN))
                / median(redis, |c| c.cpu_us.unwrap_or(f64::NAN));
            md += &format!(
                "- {op:?} window {window}: ops/s {rate:.2}x, p99 {p99:.2}x, CPU per op {cpu:.2}x\n"
            );
        }
    }
    Ok(md)
}

/// Starts one server, runs put, get and incr cells with each window against it, stops it.
async fn one_server(
    peer: Peer,
    windows: &[usize],
    ops: usize,
    cores: &str,
    cross_core: bool,
    bins: Option<&PeerBinaries>,
) -> anyhow::Result<Vec<(Op, usize, CacheCell)>> {
    let mut out = Vec::new();
    match peer {
        Peer::Felix => {
            let b = LocalBroker::start(Some(cores), "on-commit")?;
            let link = b.link();
            let shard_core = link.cache_core("bench")?;
            let connections = || link.connections();
            // Earlier connections stay open while trying again, so the core whose count
            // grew is the new one's.
            let mut tried = Vec::new();
            let (mut conn, mut conn_core) = loop {
                let before = connections()?;
                let conn = FelixConn::open(&b.target).await?;
                let core = connections()?
                    .iter()
                    .zip(&before)
                    .position(|(a, b)| a > b)
                    .unwrap_or(usize::MAX);
                if !cross_core || core != shard_core || tried.len() >= 20 {
                    break (conn, core);
                }
                tried.push(conn);
            };
            drop(tried);
            if conn_core == usize::MAX {
                conn_core = shard_core;
            }
            eprintln!(
                "  ours: connection on core {conn_core}, cache shard on core {shard_core} at the start"
            );
            let metrics = FelixDriver {
                target: b.target.clone(),
                broker: Some(b.link()),
            };
            let cpu = || link.cpu_ns();
            for op in [Op::Put, Op::Get, Op::Incr] {
                for &w in windows {
                    let cell = run_cell(&mut conn, op, w, ops, cpu, Some(&metrics)).await?;
                    out.push((op, w, cell));
                }
            }
            conn.check_counters(ops * windows.len()).await?;
            drop(conn);
            b.stop()?;
        }
        Peer::Redis => {
            let p = peers::start_redis(&bins.context("peer binaries")?.redis, true)?;
            let mut conn = RedisConn::open(p.addr).await?;
            let pid = p.pid().to_string();
            let cpu = || threads_cpu_ns(&pid, |_| true);
            for op in [Op::Put, Op::Get, Op::Incr] {
                for &w in windows {
                    let cell = run_cell(&mut conn, op, w, ops, cpu, None).await?;
                    out.push((op, w, cell));
                }
            }
            conn.check_counters(ops * windows.len()).await?;
        }
        Peer::Nats => bail!("no NATS cache cells"),
    }
    Ok(out)
}

/// The `i`-th value: its key's number in the first 8 bytes, so a get can check it.
fn value(key: usize) -> Bytes {
    let mut v = vec![0x5a; VALUE_BYTES];
    v[..8].copy_from_slice(&(key as u64).to_be_bytes());
    Bytes::from(v)
}

/// One connection to a server, as the cells use it.
trait Conn {
    /// Queues request `i` of `op` into the connection's out buffer.
    fn queue(&mut self, op: Op, i: usize);
    /// Sends what was queued.
    async fn flush(&mut self) -> anyhow::Result<()>;
    /// UDP datagrams sent and received so far, where the connection counts them.
    fn datagrams(&self) -> Option<(u64, u64)> {
        None
    }
    /// The next answer: the index of the request it answers, checked for `op`.
    async fn answer(&mut self, op: Op) -> anyhow::Result<usize>;
}

/// Runs `ops` operations of `op` with `window` in flight; checks each answer.
async fn run_cell(
    conn: &mut impl Conn,
    op: Op,
    window: usize,
    ops: usize,
    cpu: impl Fn() -> Option<u64>,
    metrics: Option<&FelixDriver>,
) -> anyhow::Result<CacheCell> {
    let stages_before = metrics.and_then(|d| d.stage_buckets());
    let datagrams_before = conn.datagrams();
    let mut sent_at: Vec<Option<Instant>> = vec![None; ops];
    let mut lat = Vec::with_capacity(ops);
    let cpu0 = cpu();
    let started = Instant::now();
    let (mut sent, mut done) = (0, 0);
    while done < ops {
        while sent < ops && sent - done < window {
            conn.queue(op, sent);
            sent_at[sent] = Some(Instant::now());
            sent += 1;
        }
        conn.flush().await?;
        let i = conn.answer(op).await?;
        let t = sent_at
            .get_mut(i)
            .and_then(Option::take)
            .with_context(|| format!("an answer to request {i}, not sent or answered twice"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        done += 1;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let datagrams = match (datagrams_before, conn.datagrams()) {
        (Some((s0, r0)), Some((s1, r1))) => {
            Some(((s1 - s0) as f64 / ops as f64, (r1 - r0) as f64 / ops as f64))
        }
        _ => None,
    };
    let cpu_us = match (cpu0, cpu()) {
        // An io_uring worker that exited took its time along: never negative.
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1e3 / ops as f64),
        _ => None,
    };
    let mut stages = Vec::new();
    if let Some(before) = stages_before {
        // The device stages are drained into the metrics every 250 ms.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let after = metrics.and_then(|d| d.stage_buckets()).unwrap_or_default();
        for ((name, b), (_, a)) in before.iter().zip(after) {
            let d: Vec<u64> = a.iter().zip(b).map(|(a, b)| a.saturating_sub(*b)).collect();
            if let (Some(p50), Some(p99)) = (bucket_quantile(&d, 0.5), bucket_quantile(&d, 0.99)) {
                stages.push((*name, p50, p99));
            }
        }
    }
    Ok(CacheCell {
        datagrams,
        rate: ops as f64 / elapsed,
        p50_us: percentile(&mut lat, 0.5),
        p99_us: percentile(&mut lat, 0.99),
        cpu_us,
        stages,
    })
}

// ---- Ours ----------------------------------------------------------------------------

struct FelixConn {
    tenant: String,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    reader: FrameReader,
    out: BytesMut,
    values: Vec<Bytes>,
    /// The endpoint is kept so the connection stays up.
    quic: (quinn::Endpoint, quinn::Connection),
}

impl FelixConn {
    async fn open(target: &Target) -> anyhow::Result<FelixConn> {
        let (ep, conn) = target.connect().await?;
        let (mut send, recv) = conn.open_bi().await?;
        send.write_all(&target.auth()).await?;
        let mut c = FelixConn {
            tenant: target.tenant.clone(),
            send,
            recv,
            reader: FrameReader::new(16 << 20),
            out: BytesMut::new(),
            values: (0..KEYS).map(value).collect(),
            quic: (ep, conn),
        };
        match c.next().await? {
            Message::AuthOk { .. } => Ok(c),
            other => bail!("auth refused: {other:?}"),
        }
    }

    async fn next(&mut self) -> anyhow::Result<Message> {
        loop {
            if let Some(f) = self.reader.next_frame()? {
                anyhow::ensure!(f.kind == FrameKind::Json, "expected a JSON answer");
                return Ok(Message::decode(&f.payload)?);
            }
            match self.recv.read_chunk(1 << 20, true).await? {
                Some(c) => self.reader.push(c.bytes),
                None => bail!("the stream ended"),
            }
        }
    }

    /// Every counter holds exactly the adds sent to it.
    async fn check_counters(&mut self, adds: usize) -> anyhow::Result<()> {
        let mut total = 0;
        for k in 0..COUNTERS {
            self.out.extend_from_slice(
                &Message::CounterGet {
                    tenant_id: self.tenant.clone(),
                    namespace: "default".into(),
                    cache: "bench".into(),
                    key: format!("n{k}"),
                    request_id: RequestId(u64::MAX - k as u64),
                }
                .to_frame(),
            );
            self.flush().await?;
            match self.next().await? {
                Message::CounterValue { value, .. } => total += value.unwrap_or(0),
                other => bail!("counter_get: {other:?}"),
            }
        }
        anyhow::ensure!(total == adds as i64, "counters sum {total}, sent {adds}");
        Ok(())
    }
}

impl Conn for FelixConn {
    fn queue(&mut self, op: Op, i: usize) {
        let (tenant_id, namespace, cache) = (
            self.tenant.clone(),
            "default".to_owned(),
            "bench".to_owned(),
        );
        let request_id = RequestId(i as u64 + 1);
        let m = match op {
            Op::Put => Message::CachePut {
                tenant_id,
                namespace,
                cache,
                key: format!("k{}", i % KEYS),
                value: self.values[i % KEYS].clone(),
                request_id: Some(request_id),
                ttl_ms: None,
            },
            Op::Get => Message::CacheGet {
                tenant_id,
                namespace,
                cache,
                key: format!("k{}", i % KEYS),
                request_id: Some(request_id),
            },
            Op::Incr => Message::CounterAdd {
                tenant_id,
                namespace,
                cache,
                key: format!("n{}", i % COUNTERS),
                delta: 1,
                request_id,
            },
        };
        self.out.extend_from_slice(&m.to_frame());
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.out.is_empty() {
            let buf = self.out.split().freeze();
            self.send.write_chunk(buf).await?;
        }
        Ok(())
    }

    fn datagrams(&self) -> Option<(u64, u64)> {
        let s = self.quic.1.stats();
        Some((s.udp_tx.datagrams, s.udp_rx.datagrams))
    }

    async fn answer(&mut self, op: Op) -> anyhow::Result<usize> {
        let m = self.next().await?;
        let (rid, ok) = match (&m, op) {
            (Message::CacheOk { request_id }, Op::Put) => (*request_id, true),
            (
                Message::CacheValue {
                    request_id: Some(r),
                    value,
                    ..
                },
                Op::Get,
            ) => {
                let i = (r.0 - 1) as usize;
                (*r, value.as_ref() == Some(&self.values[i % KEYS]))
            }
            (Message::CounterValue { request_id, value }, Op::Incr) => {
                (*request_id, value.is_some())
            }
            _ => bail!("{op:?}: answered {m:?}"),
        };
        anyhow::ensure!(ok, "{op:?}: a wrong answer {m:?}");
        Ok((rid.0 - 1) as usize)
    }
}

// ---- Redis ---------------------------------------------------------------------------

struct RedisConn {
    r: BufReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
    out: BytesMut,
    line: String,
    /// Requests sent and not answered, oldest first (Redis answers in order).
    pending: VecDeque<usize>,
    values: Vec<Bytes>,
}

impl RedisConn {
    async fn open(addr: SocketAddr) -> anyhow::Result<RedisConn> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(RedisConn {
            r: BufReader::with_capacity(1 << 20, r),
            w,
            out: BytesMut::new(),
            line: String::new(),
            pending: VecDeque::new(),
            values: (0..KEYS).map(value).collect(),
        })
    }

    async fn check_counters(&mut self, adds: usize) -> anyhow::Result<()> {
        let mut total = 0;
        for k in 0..COUNTERS {
            resp_command(&mut self.out, &[b"GET", format!("n{k}").as_bytes()]);
            self.flush().await?;
            match read_resp(&mut self.r, &mut self.line).await? {
                Some(Resp::Bulk(Some(v))) => total += std::str::from_utf8(&v)?.parse::<i64>()?,
                other => bail!("GET n{k}: {other:?}"),
            }
        }
        anyhow::ensure!(total == adds as i64, "counters sum {total}, sent {adds}");
        Ok(())
    }
}

impl Conn for RedisConn {
    fn queue(&mut self, op: Op, i: usize) {
        match op {
            Op::Put => resp_command(
                &mut self.out,
                &[
                    b"SET",
                    format!("k{}", i % KEYS).as_bytes(),
                    &self.values[i % KEYS],
                ],
            ),
            Op::Get => resp_command(
                &mut self.out,
                &[b"GET", format!("k{}", i % KEYS).as_bytes()],
            ),
            Op::Incr => resp_command(
                &mut self.out,
                &[b"INCRBY", format!("n{}", i % COUNTERS).as_bytes(), b"1"],
            ),
        }
        self.pending.push_back(i);
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.out.is_empty() {
            self.w.write_all(&self.out).await?;
            self.out.clear();
        }
        Ok(())
    }

    async fn answer(&mut self, op: Op) -> anyhow::Result<usize> {
        let v = read_resp(&mut self.r, &mut self.line)
            .await?
            .context("redis closed")?;
        let i = self.pending.pop_front().context("an answer to nothing")?;
        let ok = match (&v, op) {
            (Resp::Simple, Op::Put) | (Resp::Int, Op::Incr) => true,
            (Resp::Bulk(Some(b)), Op::Get) => *b == self.values[i % KEYS],
            _ => false,
        };
        anyhow::ensure!(ok, "{op:?}: answered {v:?}");
        Ok(i)
    }
}
