//! `felix-bench queue`: consumer groups (queues), side by side with NATS JetStream pull
//! consumers (explicit, synchronous acks) and Redis Streams consumer groups
//! (XREADGROUP / XACK), every broker durable (our on-commit fsync, NATS
//! `sync_interval: always`, Redis `appendfsync always`), in one run on one machine.
//!
//! Each cell: `records` 1 KiB records are published first (not timed); then `consumers`
//! consumers each loop "claim up to `batch`, acknowledge each record" until every
//! record is consumed. Throughput is records acknowledged per second of the consuming
//! phase; latency is one claim-plus-acknowledgements round (claim sent → last ack
//! answered), p50 and p99. Every record must be consumed exactly as many times as the
//! broker hands it out (nothing is lost: the cell fails if the consumers stop short).
//! How each broker acknowledges: ours one `group_ack` per record, pipelined on one
//! stream; NATS one `+ACK` per message with a reply (an ack the server confirms),
//! pipelined; Redis one `XACK` naming the whole batch (its idiom: one command).

use std::net::SocketAddr;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::{Bytes, BytesMut};
use felix_wire::flags::FrameKind;
use felix_wire::{FrameReader, Message, Offset, RequestId, ShardId};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::broker::LocalBroker;
use crate::client::Target;
use crate::compare::Peer;
use crate::drivers::{
    Driver, FelixDriver, NatsDriver, NatsMsg, RedisDriver, Resp, nats_connect, nats_read,
    nats_request, read_resp, resp_command, stamp_now, stamped,
};
use crate::peers::{self, PeerBinaries};
use crate::stats::percentile;

/// One cell's result.
#[derive(Debug, Clone, Copy)]
pub struct QueueCell {
    /// Records acknowledged per second.
    pub rate: f64,
    /// Claim-and-ack round, µs.
    pub p50_us: f64,
    /// Claim-and-ack round, µs.
    pub p99_us: f64,
    /// The broker's CPU per acknowledged record (its threads' schedstat over the
    /// consuming phase), µs.
    pub cpu_us: Option<f64>,
}

/// Runs the queue cells for `peers` with each consumer count; prints a table with the
/// ratio of ours to the better peer. Medians of `rounds`.
pub fn run(
    peers: &[Peer],
    consumers: &[usize],
    records: usize,
    batch: usize,
    rounds: usize,
) -> anyhow::Result<String> {
    let bins = if peers.iter().any(|p| *p != Peer::Felix) {
        Some(PeerBinaries::install()?)
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut cells: Vec<(Peer, usize, Vec<QueueCell>)> = Vec::new();
    for round in 0..rounds.max(1) {
        eprintln!("round {} of {}", round + 1, rounds.max(1));
        for &peer in peers {
            for &n in consumers {
                let cell = rt.block_on(one_cell(peer, n, records, batch, bins.as_ref()))?;
                eprintln!(
                    "  {peer:?} x{n}: {:.0} records/s, round p50 {:.0} µs p99 {:.0} µs, CPU {} µs/record",
                    cell.rate,
                    cell.p50_us,
                    cell.p99_us,
                    cpu_text(cell.cpu_us)
                );
                match cells.iter_mut().find(|(p, c, _)| *p == peer && *c == n) {
                    Some((_, _, v)) => v.push(cell),
                    None => cells.push((peer, n, vec![cell])),
                }
            }
        }
    }
    let median = |v: &[QueueCell], f: fn(&QueueCell) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let mut md = String::from(
        "| broker | consumers | records/s | round p50 µs | round p99 µs | broker CPU µs/record |\n|---|---|---|---|---|---|\n",
    );
    for (peer, n, v) in &cells {
        let cpu = v
            .iter()
            .all(|c| c.cpu_us.is_some())
            .then(|| median(v, |c| c.cpu_us.unwrap_or(0.0)));
        md += &format!(
            "| {peer:?} | {n} | {:.0} | {:.0} | {:.0} | {} |\n",
            median(v, |c| c.rate),
            median(v, |c| c.p50_us),
            median(v, |c| c.p99_us),
            cpu_text(cpu)
        );
    }
    for &n in consumers {
        let rate = |p: Peer| {
            cells
                .iter()
                .find(|(q, c, _)| *q == p && *c == n)
                .map(|(_, _, v)| median(v, |c| c.rate))
        };
        let best_peer = [Peer::Nats, Peer::Redis]
            .into_iter()
            .filter_map(rate)
            .fold(None, |a: Option<f64>, r| Some(a.map_or(r, |a| a.max(r))));
        if let (Some(ours), Some(best)) = (rate(Peer::Felix), best_peer) {
            md += &format!(
                "\n{n} consumer(s): ours / better peer = {:.2}x",
                ours / best
            );
        }
    }
    Ok(md)
}

fn cpu_text(cpu: Option<f64>) -> String {
    cpu.map_or_else(|| "-".into(), |c| format!("{c:.1}"))
}

async fn one_cell(
    peer: Peer,
    consumers: usize,
    records: usize,
    batch: usize,
    bins: Option<&PeerBinaries>,
) -> anyhow::Result<QueueCell> {
    let stream = format!("q{}", stamp_now());
    match peer {
        Peer::Felix => {
            let b = LocalBroker::start(Some("0-1"), "on-commit")?;
            let driver = FelixDriver {
                target: b.target.clone(),
                broker: Some(b.link()),
            };
            fill(&driver, &stream, records).await?;
            let target = b.target.clone();
            let cell = consume(&driver, consumers, records, |i| {
                let (target, stream) = (target.clone(), stream.clone());
                async move { felix_consumer(target, stream, i, batch).await }
            })
            .await;
            b.stop()?;
            cell
        }
        Peer::Nats => {
            let p = peers::start_nats(&bins.context("peer binaries")?.nats, true)?;
            let driver = NatsDriver {
                addr: p.addr,
                pid: Some(p.pid()),
            };
            driver.create(stream.clone()).await?;
            fill(&driver, &stream, records).await?;
            nats_request(
                p.addr,
                &format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.workers"),
                &serde_json::json!({"stream_name": stream, "config": {
                    "durable_name": "workers", "ack_policy": "explicit",
                    "max_ack_pending": 1_000_000, "ack_wait": 60_000_000_000u64,
                    "max_waiting": 512}})
                .to_string(),
            )
            .await?;
            let addr = p.addr;
            consume(&driver, consumers, records, |i| {
                let stream = stream.clone();
                async move { nats_consumer(addr, stream, i, batch).await }
            })
            .await
        }
        Peer::Redis => {
            let p = peers::start_redis(&bins.context("peer binaries")?.redis, true)?;
            let driver = RedisDriver {
                addr: p.addr,
                pid: Some(p.pid()),
            };
            fill(&driver, &stream, records).await?;
            let addr = p.addr;
            redis_call(
                addr,
                &[b"XGROUP", b"CREATE", stream.as_bytes(), b"workers", b"0"],
            )
            .await?;
            consume(&driver, consumers, records, |i| {
                let stream = stream.clone();
                async move { redis_consumer(addr, stream, i, batch).await }
            })
            .await
        }
    }
}

/// Publishes `records` 1 KiB records in batches of 64 (not timed).
async fn fill(driver: &dyn Driver, stream: &str, records: usize) -> anyhow::Result<()> {
    let mut p = driver.producer(stream.to_owned(), 64).await?;
    let payloads: Vec<Bytes> = (0..64).map(|_| stamped(1024, stamp_now())).collect();
    let mut sent = 0;
    while sent < records {
        let n = (records - sent).min(64);
        p.send(&payloads[..n], Instant::now()).await?;
        sent += n;
    }
    p.finish().await?;
    Ok(())
}

/// What one consumer reports: records acknowledged, its rounds' latencies in µs, and
/// when its last round with records ended.
type Consumed = anyhow::Result<(usize, Vec<f64>, Option<Instant>)>;

/// Runs `consumers` consumers until together they acknowledged `records`.
async fn consume<F, Fut>(
    driver: &dyn Driver,
    consumers: usize,
    records: usize,
    make: F,
) -> anyhow::Result<QueueCell>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Consumed> + Send + 'static,
{
    let cpu_before = driver.server_cpu_ns();
    let started = Instant::now();
    let tasks: Vec<_> = (0..consumers).map(|i| tokio::spawn(make(i))).collect();
    let (mut total, mut lat, mut end) = (0, Vec::new(), None);
    for t in tasks {
        let (n, l, last) = t.await??;
        total += n;
        lat.extend(l);
        end = end.max(last);
    }
    // Up to the last acknowledged round: the consumers' drain (empty polls of up to
    // 200 ms each before they stop, a peer's partial pull waiting out its expiry) was
    // in the window, some 0.4 s of a few seconds' run, for every broker alike.
    let elapsed = end
        .map_or_else(|| started.elapsed(), |e| e.duration_since(started))
        .as_secs_f64();
    let cpu_us = match (cpu_before, driver.server_cpu_ns()) {
        (Some(a), Some(b)) if total > 0 => Some(b.saturating_sub(a) as f64 / 1e3 / total as f64),
        _ => None,
    };
    anyhow::ensure!(total >= records, "consumed {total} of {records}");
    Ok(QueueCell {
        rate: total as f64 / elapsed,
        p50_us: percentile(&mut lat, 0.5),
        p99_us: percentile(&mut lat, 0.99),
        cpu_us,
    })
}

/// Consumers stop after this many empty claims in a row (the queue is drained).
const EMPTY_POLLS_TO_STOP: usize = 2;

// ---- Ours ----------------------------------------------------------------------------

async fn felix_consumer(target: Target, stream: String, i: usize, batch: usize) -> Consumed {
    let (_ep, conn) = target.connect().await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&target.auth()).await?;
    let mut reader = FrameReader::new(16 << 20);
    match next_json(&mut recv, &mut reader).await? {
        Message::AuthOk { .. } => {}
        other => bail!("auth refused: {other:?}"),
    }
    let (mut done, mut lat, mut empty, mut rid) = (0, Vec::new(), 0, i as u64 * 1_000_000_000);
    let mut last = None;
    let mut buf = BytesMut::new();
    while empty < EMPTY_POLLS_TO_STOP {
        let t = Instant::now();
        rid += 1;
        send.write_all(
            &Message::GroupPoll {
                tenant_id: target.tenant.clone(),
                namespace: "default".into(),
                stream: stream.clone(),
                shard: ShardId(0),
                group: "workers".into(),
                max_records: batch as u32,
                wait_ms: 200,
                request_id: RequestId(rid),
                consumer: None,
                reclaim: false,
                visibility_ms: Some(60_000),
            }
            .to_frame(),
        )
        .await?;
        let records = match next_json(&mut recv, &mut reader).await? {
            Message::GroupRecords { records, .. } => records,
            other => bail!("poll: {other:?}"),
        };
        if records.is_empty() {
            empty += 1;
            continue;
        }
        empty = 0;
        buf.clear();
        for r in &records {
            rid += 1;
            buf.extend_from_slice(
                &Message::GroupAck {
                    tenant_id: target.tenant.clone(),
                    namespace: "default".into(),
                    stream: stream.clone(),
                    shard: ShardId(0),
                    group: "workers".into(),
                    offset: Offset(r.offset.0),
                    request_id: RequestId(rid),
                }
                .to_frame(),
            );
        }
        send.write_all(&buf).await?;
        for _ in &records {
            match next_json(&mut recv, &mut reader).await? {
                Message::CacheOk { .. } => {}
                other => bail!("ack: {other:?}"),
            }
        }
        done += records.len();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        last = Some(Instant::now());
    }
    Ok((done, lat, last))
}

async fn next_json(
    recv: &mut quinn::RecvStream,
    reader: &mut FrameReader,
) -> anyhow::Result<Message> {
    loop {
        if let Some(f) = reader.next_frame()? {
            anyhow::ensure!(f.kind == FrameKind::Json, "expected a JSON answer");
            return Ok(Message::decode(&f.payload)?);
        }
        match recv.read_chunk(1 << 20, true).await? {
            Some(c) => reader.push(c.bytes),
            None => bail!("the stream ended"),
        }
    }
}

// ---- NATS JetStream ----------------------------------------------------------------------

async fn nats_consumer(addr: SocketAddr, stream: String, i: usize, batch: usize) -> Consumed {
    let (mut r, mut w) = nats_connect(addr).await?;
    let (inbox, acks) = (format!("_INBOX.q{i}"), format!("_INBOX.a{i}"));
    w.write_all(format!("SUB {inbox} 1\r\nSUB {acks} 2\r\n").as_bytes())
        .await?;
    let next = format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.workers");
    let request = format!("{{\"batch\":{batch},\"expires\":200000000}}");
    let (mut done, mut lat, mut empty) = (0, Vec::new(), 0);
    let mut last = None;
    let mut line = String::new();
    while empty < EMPTY_POLLS_TO_STOP {
        let t = Instant::now();
        w.write_all(format!("PUB {next} {inbox} {}\r\n{request}\r\n", request.len()).as_bytes())
            .await?;
        // Messages until the batch is full or a status (no messages, timeout) ends it.
        let mut replies = Vec::with_capacity(batch);
        // When the round's last record came: a partial batch then waits out the
        // request's expiry (200 ms) for the status that ends it, which ours and Redis's
        // partial answers do not.
        let mut last_record = t;
        loop {
            match nats_read(&mut r, &mut line).await?.context("nats closed")? {
                NatsMsg::Msg {
                    reply: Some(reply), ..
                } if reply.starts_with("$JS.ACK") => {
                    last_record = Instant::now();
                    replies.push(reply);
                    if replies.len() == batch {
                        break;
                    }
                }
                NatsMsg::Msg { .. } => break,
                NatsMsg::Ping => w.write_all(b"PONG\r\n").await?,
                NatsMsg::Err(e) => bail!("nats: {e}"),
                NatsMsg::Other => {}
            }
        }
        if replies.is_empty() {
            empty += 1;
            continue;
        }
        empty = 0;
        let mut buf = BytesMut::new();
        for reply in &replies {
            buf.extend_from_slice(format!("PUB {reply} {acks} 4\r\n+ACK\r\n").as_bytes());
        }
        let acks_sent = Instant::now();
        w.write_all(&buf).await?;
        let mut confirmed = 0;
        while confirmed < replies.len() {
            match nats_read(&mut r, &mut line).await?.context("nats closed")? {
                NatsMsg::Msg { .. } => confirmed += 1,
                NatsMsg::Ping => w.write_all(b"PONG\r\n").await?,
                NatsMsg::Err(e) => bail!("nats ack: {e}"),
                NatsMsg::Other => {}
            }
        }
        done += replies.len();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        // The round as if its acks had gone with its last record (see `last_record`).
        last = Some(last_record + acks_sent.elapsed());
    }
    Ok((done, lat, last))
}

// ---- Redis Streams ---------------------------------------------------------------------

async fn redis_call(addr: SocketAddr, args: &[&[u8]]) -> anyhow::Result<()> {
    let s = TcpStream::connect(addr).await?;
    let (r, mut w) = s.into_split();
    let mut r = BufReader::new(r);
    let mut buf = BytesMut::new();
    resp_command(&mut buf, args);
    w.write_all(&buf).await?;
    let mut line = String::new();
    match read_resp(&mut r, &mut line).await? {
        Some(Resp::Error(e)) => bail!("redis: {e}"),
        Some(_) => Ok(()),
        None => bail!("redis closed"),
    }
}

async fn redis_consumer(addr: SocketAddr, stream: String, i: usize, batch: usize) -> Consumed {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (r, mut w) = s.into_split();
    let mut r = BufReader::with_capacity(1 << 20, r);
    let (name, count) = (format!("c{i}"), batch.to_string());
    let (mut done, mut lat, mut empty) = (0, Vec::new(), 0);
    let mut last = None;
    let mut line = String::new();
    let mut buf = BytesMut::new();
    while empty < EMPTY_POLLS_TO_STOP {
        let t = Instant::now();
        buf.clear();
        resp_command(
            &mut buf,
            &[
                b"XREADGROUP",
                b"GROUP",
                b"workers",
                name.as_bytes(),
                b"COUNT",
                count.as_bytes(),
                b"BLOCK",
                b"200",
                b"STREAMS",
                stream.as_bytes(),
                b">",
            ],
        );
        w.write_all(&buf).await?;
        let v = read_resp(&mut r, &mut line)
            .await?
            .context("redis closed")?;
        let mut ids: Vec<Bytes> = Vec::new();
        if let Resp::Array(Some(streams)) = v {
            for s in streams {
                let Resp::Array(Some(mut pair)) = s else {
                    continue;
                };
                let Some(Resp::Array(Some(entries))) = pair.pop() else {
                    continue;
                };
                for e in entries {
                    let Resp::Array(Some(entry)) = e else {
                        continue;
                    };
                    if let Some(Resp::Bulk(Some(id))) = entry.into_iter().next() {
                        ids.push(id);
                    }
                }
            }
        } else if let Resp::Error(e) = v {
            bail!("redis XREADGROUP: {e}");
        }
        if ids.is_empty() {
            empty += 1;
            continue;
        }
        empty = 0;
        buf.clear();
        let mut args: Vec<&[u8]> = vec![b"XACK", stream.as_bytes(), b"workers"];
        args.extend(ids.iter().map(|id| id.as_ref()));
        resp_command(&mut buf, &args);
        w.write_all(&buf).await?;
        if let Resp::Error(e) = read_resp(&mut r, &mut line)
            .await?
            .context("redis closed")?
        {
            bail!("redis XACK: {e}");
        }
        done += ids.len();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        last = Some(Instant::now());
    }
    Ok((done, lat, last))
}
