//! Broker throughput and latency, with our wire-level load client (see [`crate::client`]).
//!
//! Starts `felix-broker dev` in this process on a temporary data directory, then for
//! each cell: opens `fanout` subscribers, publishes 1 KiB records in batches of `batch`
//! for a fixed time from one pipelined stream per publisher, and counts acknowledged and
//! delivered records. Latency: one publisher, one record per batch, one at a time
//! (ack latency), with a subscriber measuring publish-to-delivery.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_broker::config::{BrokerConfig, FileConfig, Overrides};

use crate::client::{Publisher, Subscriber, Target};
use crate::stats::percentile;

/// One measured cell.
#[derive(Debug, Clone)]
pub struct Cell {
    /// Records per batch.
    pub batch: usize,
    /// Subscribers.
    pub fanout: usize,
    /// Acknowledged records per second.
    pub acked_per_sec: f64,
    /// Delivered records per second (all subscribers).
    pub delivered_per_sec: f64,
    /// Payload MB/s acknowledged.
    pub mb_per_sec: f64,
    /// Deliveries dropped by full subscriber queues (DropNew).
    pub lost: u64,
}

/// A running in-process broker.
pub struct LocalBroker {
    broker: Option<felix_broker::server::Broker>,
    _dir: tempfile::TempDir,
    /// How to reach it.
    pub target: Target,
    /// Its operator HTTP endpoint (`/pins`, `/cores`).
    pub http: Option<std::net::SocketAddr>,
}

impl std::fmt::Debug for LocalBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBroker")
            .field("addr", &self.target.addr)
            .finish()
    }
}

impl LocalBroker {
    /// Starts one with `cores` and `fsync`.
    pub fn start(cores: Option<&str>, fsync: &str) -> anyhow::Result<LocalBroker> {
        Self::start_with(cores, fsync, &[], None)
    }

    /// Starts one with operator pin rules, over `dir` when given (a restart) or a fresh
    /// temporary directory.
    pub fn start_with(
        cores: Option<&str>,
        fsync: &str,
        pins: &[String],
        dir: Option<tempfile::TempDir>,
    ) -> anyhow::Result<LocalBroker> {
        let dir = match dir {
            Some(d) => d,
            None => tempfile::Builder::new()
                .prefix("felix-bench")
                .tempdir_in("/var/tmp")?,
        };
        let config = BrokerConfig::resolve(
            FileConfig {
                pins: pins.to_vec(),
                ..FileConfig::default()
            },
            Overrides {
                listen: Some("127.0.0.1:0".into()),
                http: Some("127.0.0.1:0".into()),
                data_dir: Some(dir.path().join("data")),
                cores: cores.map(str::to_owned),
                fsync: Some(fsync.into()),
                default_shards: Some(1),
                ..Overrides::default()
            },
            true,
        )?;
        let setup = felix_broker::dev::prepare(&config.data_dir, "dev")?;
        let broker = felix_broker::server::start(
            &config,
            &setup.cert_pem,
            &setup.key_pem,
            setup.keys.clone(),
        )?;
        let target = Target {
            addr: broker.started.listen,
            ca_pem: std::fs::read_to_string(&setup.ca_path)?,
            tenant: "dev".into(),
            token: setup.token.clone(),
        };
        let http = broker.started.http;
        Ok(LocalBroker {
            http,
            broker: Some(broker),
            _dir: dir,
            target,
        })
    }

    /// Stops it.
    pub fn stop(mut self) -> anyhow::Result<()> {
        if let Some(b) = self.broker.take() {
            b.shutdown()?;
        }
        Ok(())
    }

    /// Stops it and keeps its data directory (for a restart over it).
    pub fn stop_keep(mut self) -> anyhow::Result<tempfile::TempDir> {
        if let Some(b) = self.broker.take() {
            b.shutdown()?;
        }
        Ok(std::mem::replace(&mut self._dir, tempfile::tempdir()?))
    }

    /// The broker's shared state (its metrics).
    pub fn shared(&self) -> Option<std::sync::Arc<felix_broker::core::Shared>> {
        self.broker.as_ref().map(|b| b.shared.clone())
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.target.addr
    }
}

/// Publishes `count` records in total and waits until every subscriber has all of them.
pub async fn delivery_cell(
    target: &Target,
    stream: &str,
    batch: usize,
    fanout: usize,
    count: u64,
) -> anyhow::Result<Cell> {
    let mut subs = Vec::new();
    for _ in 0..fanout {
        let (ep, conn) = target.connect().await?;
        let sub = Subscriber::open(target, &conn, "default", stream).await?;
        subs.push((ep, conn, sub));
    }
    let (_ep, conn) = target.connect().await?;
    let mut publisher = Publisher::open(target, &conn, 256).await?;
    let payloads: Vec<Bytes> = (0..batch)
        .map(|i| Bytes::from(vec![i as u8; 1024]))
        .collect();
    let batches = count.div_ceil(batch as u64);
    let total = batches * batch as u64;
    let counters: Vec<_> = subs
        .into_iter()
        .map(|(ep, conn, mut sub)| {
            tokio::spawn(async move {
                let _keep = (ep, conn);
                let mut n = 0u64;
                let mut last = Instant::now();
                while n < total {
                    // Dropped deliveries never come: stop after 2 s of silence.
                    match tokio::time::timeout(Duration::from_secs(2), sub.next()).await {
                        Ok(Ok(Some((_, recs)))) => {
                            n += recs.len() as u64;
                            last = Instant::now();
                        }
                        _ => break,
                    }
                }
                (n, last)
            })
        })
        .collect();
    let started = Instant::now();
    for _ in 0..batches {
        publisher
            .publish(target, "default", stream, &payloads)
            .await?;
    }
    publisher.finish().await?;
    let acked_secs = started.elapsed().as_secs_f64();
    let mut delivered = 0;
    let mut last = started;
    for c in counters {
        let (n, at) = c.await?;
        delivered += n;
        last = last.max(at);
    }
    let delivered_secs = last.duration_since(started).as_secs_f64().max(acked_secs);
    Ok(Cell {
        lost: total * fanout as u64 - delivered,
        batch,
        fanout,
        acked_per_sec: total as f64 / acked_secs,
        delivered_per_sec: delivered as f64 / delivered_secs,
        mb_per_sec: total as f64 * 1024.0 / acked_secs / 1e6,
    })
}

/// Ack and publish-to-delivery latency (µs) of single 1 KiB records sent one at a time.
pub async fn latency(
    target: &Target,
    stream: &str,
    samples: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let (_ep1, sconn) = target.connect().await?;
    let mut sub = Subscriber::open(target, &sconn, "default", stream).await?;
    let (_ep2, conn) = target.connect().await?;
    let mut publisher = Publisher::open(target, &conn, 1).await?;
    let payload = [Bytes::from(vec![7u8; 1024])];
    let mut e2e = Vec::with_capacity(samples);
    for i in 0..samples + samples / 10 {
        let t = Instant::now();
        publisher
            .publish(target, "default", stream, &payload)
            .await?;
        sub.next()
            .await?
            .ok_or_else(|| anyhow::anyhow!("subscription ended"))?;
        if i >= samples / 10 {
            e2e.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let mut acks = publisher.finish().await?;
    acks.drain(..samples / 10);
    Ok((acks, e2e))
}

/// Runs the first broker figure and prints it.
pub fn run(cores: Option<&str>, fsync: &str, count: u64, samples: usize) -> anyhow::Result<()> {
    let broker = LocalBroker::start(cores, fsync)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let target = broker.target.clone();
    let result = rt.block_on(async move {
        let mut cells = Vec::new();
        // A warm-up cell opens the shard machinery and the first timers.
        delivery_cell(&target, "warmup", 16, 1, 20_000).await?;
        for (i, (batch, fanout)) in [(1usize, 1usize), (1, 10), (64, 1), (64, 10)]
            .into_iter()
            .enumerate()
        {
            let n = if batch == 1 { count / 8 } else { count };
            cells.push(delivery_cell(&target, &format!("cell{i}"), batch, fanout, n).await?);
            eprint!(".");
        }
        let (mut acks, mut e2e) = latency(&target, "latency", samples).await?;
        eprintln!();
        anyhow::Ok((
            cells,
            percentile(&mut acks, 0.5),
            percentile(&mut acks, 0.99),
            percentile(&mut e2e, 0.5),
            percentile(&mut e2e, 0.99),
        ))
    });
    broker.stop()?;
    let (cells, a50, a99, e50, e99) = result?;
    println!(
        "broker: felix-broker dev, cores {}, fsync {fsync}, 1 KiB records, one publisher stream (window 256)",
        cores.unwrap_or("all")
    );
    println!("| batch | fanout | acked msgs/s | MB/s | delivered msgs/s | dropped deliveries |");
    println!("|---|---|---|---|---|---|");
    for c in &cells {
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.0} | {} |",
            c.batch, c.fanout, c.acked_per_sec, c.mb_per_sec, c.delivered_per_sec, c.lost
        );
    }
    println!(
        "\nbatch 1, one at a time: ack p50 {a50:.0} us, p99 {a99:.0} us; publish-to-delivery p50 {e50:.0} us, p99 {e99:.0} us"
    );
    Ok(())
}
