//! `felix-bench compare`: the scenario matrix against our broker and the peers, in one
//! run on one machine, written out as JSON, a Markdown table with ratios, and SVG plots.
//!
//! Method (docs/benchmarks.md has the long form):
//! - Every broker runs on loopback on this machine, sharing its cores with the load
//!   generator (a tokio runtime in this process). Ours runs in a process of its own
//!   (`felix-bench serve-broker`) on `--cores`, as each peer runs in its own.
//! - Closed loop: each producer keeps a window of batches in flight and sends the next as
//!   soon as there is room; throughput = records acknowledged / time to the last ack.
//! - Open loop (S12): batches are due at fixed intervals; ack latency is measured from the
//!   due time, so a broker that falls behind is charged for the wait (no coordinated
//!   omission).
//! - Consumers open before producers; every cell checks that each consumer received every
//!   record and fails on loss or timeout. A warm-up cell per broker is not reported.
//! - Durable cells (S6-S8, S12 durable) sync before acknowledging on every broker; the
//!   others acknowledge once the write is handed to the OS, again on every broker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde_json::{Value, json};

use crate::broker::LocalBroker;
use crate::drivers::{Driver, FelixDriver, NatsDriver, RedisDriver, stamp_now, stamped};
use crate::peers::{self, PeerBinaries};
use crate::stats::percentile;

/// How big each cell is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scale {
    /// Seconds in total: what `cargo test` runs so the tool cannot rot.
    Tiny,
    /// A few minutes: the documented run.
    Small,
    /// Longer cells, steadier numbers.
    Full,
}

impl Scale {
    /// Records per batch-64 cell.
    fn records(self) -> u64 {
        match self {
            Scale::Tiny => 2_048,
            Scale::Small => 128_000,
            Scale::Full => 512_000,
        }
    }

    /// Latency samples.
    fn samples(self) -> usize {
        match self {
            Scale::Tiny => 40,
            Scale::Small => 2_000,
            Scale::Full => 5_000,
        }
    }
}

/// Which brokers to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Peer {
    /// Ours.
    Felix,
    /// NATS JetStream.
    Nats,
    /// Redis Streams.
    Redis,
}

/// Run settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Cell size.
    pub scale: Scale,
    /// Brokers.
    pub peers: Vec<Peer>,
    /// Our broker's cores.
    pub cores: String,
    /// Where results go.
    pub out: std::path::PathBuf,
    /// Print a progress bar per run.
    pub progress: bool,
    /// Repetitions of the matrix (medians reported).
    pub rounds: usize,
    /// Only these scenario ids (empty: all), including the ours-only figures (`S13`,
    /// `pinning`, `S14`, `S11`).
    pub only: Vec<String>,
    /// Run the load generator only on these CPUs, and confine every broker (ours by
    /// `cores` and [`confine_ours`], each peer's process by affinity) to `cores`: the
    /// per-core cell a machine whose other cores run the load can measure honestly.
    pub load_cores: Option<String>,
}

/// Sets the CPU affinity of thread or process `tid` (0: the calling thread).
pub fn confine(tid: i32, cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it for
    // CPUs below CPU_SETSIZE, which `cpus` (from /proc) are.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Confines every thread of process `pid` to `cpus` (threads it starts later inherit).
pub fn confine_process(pid: u32, cpus: &[usize]) -> std::io::Result<()> {
    for tid in threads(pid)? {
        confine(tid, cpus)?;
    }
    Ok(())
}

/// The ids of process `pid`'s threads now.
fn threads(pid: u32) -> std::io::Result<impl Iterator<Item = i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))?;
    Ok(tasks
        .flatten()
        .filter_map(|t| t.file_name().to_str().and_then(|t| t.parse().ok())))
}

/// Whether thread `tid` may run only on CPUs of `cpus`.
fn within(tid: i32, cpus: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set for the kernel to fill; CPU_ISSET
    // reads within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return false;
        }
        (0..libc::CPU_SETSIZE as usize).all(|c| !libc::CPU_ISSET(c, &set) || cpus.contains(&c))
    }
}

/// Confines our broker's threads to `cpus`, as a peer's whole process is, leaving those
/// already within them: its cores keep their own pins (one CPU each, within `cpus`), and
/// its other threads (control, HTTP, blocking pools) share the broker's CPUs instead of
/// the load's. A thread that exits meanwhile is passed over, as is one whose affinity
/// the kernel does not let us set (an io_uring worker on some kernels: those follow the
/// ring's owner, a core, and may run outside `cpus` there).
pub fn confine_ours(pid: u32, cpus: &[usize]) -> std::io::Result<()> {
    for tid in threads(pid)? {
        if within(tid, cpus) {
            continue;
        }
        match confine(tid, cpus) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::EINVAL)) => {}
            other => other?,
        }
    }
    Ok(())
}

pub(crate) fn parse_cpus(list: &str) -> anyhow::Result<Vec<usize>> {
    let set: felix_core_runtime::cores::CoreSet = list
        .parse()
        .map_err(|e| anyhow::anyhow!("CPU list {list:?}: {e}"))?;
    Ok(set.cpus().to_vec())
}

/// One scenario cell's shape.
#[derive(Debug, Clone, Copy)]
struct Spec {
    id: &'static str,
    what: &'static str,
    size: usize,
    batch: usize,
    fanout: usize,
    producers: usize,
    durable: bool,
    /// Batches in flight per producer (1 = one at a time).
    window: usize,
    /// Records per producer, as a fraction of the scale's batch-64 count.
    share: f64,
    /// Open loop at this fraction of a throughput scenario's maximum.
    open_of: Option<(&'static str, f64)>,
}

const SPECS: &[Spec] = &[
    Spec {
        id: "S1",
        what: "1 KiB, batch 1, fanout 1, one at a time (latency)",
        size: 1024,
        batch: 1,
        fanout: 1,
        producers: 1,
        durable: false,
        window: 1,
        share: 0.0,
        open_of: None,
    },
    Spec {
        id: "S1d",
        what: "1 KiB, batch 1, fanout 1, one at a time, fsync before ack (latency)",
        size: 1024,
        batch: 1,
        fanout: 1,
        producers: 1,
        durable: true,
        window: 1,
        share: 0.0,
        open_of: None,
    },
    Spec {
        id: "S2",
        what: "1 KiB, batch 1, fanout 10",
        size: 1024,
        batch: 1,
        fanout: 10,
        producers: 1,
        durable: false,
        window: 256,
        share: 0.125,
        open_of: None,
    },
    Spec {
        id: "S3",
        what: "1 KiB, batch 64, fanout 1",
        size: 1024,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: false,
        window: 64,
        share: 1.0,
        open_of: None,
    },
    Spec {
        id: "S4a",
        what: "4 KiB, batch 64",
        size: 4096,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: false,
        window: 32,
        share: 0.25,
        open_of: None,
    },
    Spec {
        id: "S4b",
        what: "16 KiB, batch 64",
        size: 16384,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: false,
        window: 16,
        share: 0.0625,
        open_of: None,
    },
    Spec {
        id: "S5",
        what: "1 KiB, batch 64, fanout 10 (delivered)",
        size: 1024,
        batch: 64,
        fanout: 10,
        producers: 1,
        durable: false,
        window: 64,
        share: 0.25,
        open_of: None,
    },
    Spec {
        id: "S6",
        what: "1 KiB, batch 1, fsync before ack",
        size: 1024,
        batch: 1,
        fanout: 1,
        producers: 1,
        durable: true,
        window: 256,
        share: 0.0625,
        open_of: None,
    },
    Spec {
        id: "S7",
        what: "1 KiB, batch 64, 1 producer, fsync before ack",
        size: 1024,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: true,
        window: 64,
        share: 0.5,
        open_of: None,
    },
    Spec {
        id: "S8",
        what: "128 B, 64 producers, fsync before ack",
        size: 128,
        batch: 1,
        fanout: 1,
        producers: 64,
        durable: true,
        window: 1,
        share: 0.005,
        open_of: None,
    },
    Spec {
        id: "S12a",
        what: "open loop at 50% of S3",
        size: 1024,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: false,
        window: 4096,
        share: 0.25,
        open_of: Some(("S3", 0.5)),
    },
    Spec {
        id: "S12b",
        what: "open loop at 80% of S3",
        size: 1024,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: false,
        window: 4096,
        share: 0.25,
        open_of: Some(("S3", 0.8)),
    },
    Spec {
        id: "S12c",
        what: "open loop at 50% of S7 (fsync)",
        size: 1024,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: true,
        window: 4096,
        share: 0.125,
        open_of: Some(("S7", 0.5)),
    },
    Spec {
        id: "S12d",
        what: "open loop at 80% of S7 (fsync)",
        size: 1024,
        batch: 64,
        fanout: 1,
        producers: 1,
        durable: true,
        window: 4096,
        share: 0.125,
        open_of: Some(("S7", 0.8)),
    },
];

/// What one cell measured.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    /// Records acknowledged per second.
    pub acked_per_sec: f64,
    /// Payload MB/s acknowledged.
    pub mb_per_sec: f64,
    /// Records delivered per second, all consumers.
    pub delivered_per_sec: f64,
    /// Ack latency percentiles (µs): p50, p99, p999.
    pub ack: [f64; 3],
    /// Publish-to-delivery percentiles (µs), latency cells only.
    pub e2e: Option<[f64; 3]>,
    /// Ack latency curve (percentile, µs) for plots.
    pub curve: Vec<(f64, f64)>,
    /// Batches made durable per device sync (fdatasync or O_DSYNC write) during the
    /// cell (ours, durable cells).
    pub appends_per_flush: Option<f64>,
    /// The broker's CPU time per acknowledged message (µs), deliveries included: its
    /// threads' schedstat over the cell (every thread of the broker's process).
    pub server_cpu_us: Option<f64>,
    /// Ours: each stage's p50 and p99 (µs, bucket bounds) over the cell, from the
    /// broker's per-core histograms.
    pub stages: Vec<(&'static str, f64, f64)>,
}

fn pcts(v: &mut [f64]) -> [f64; 3] {
    [
        percentile(v, 0.5),
        percentile(v, 0.99),
        percentile(v, 0.999),
    ]
}

fn curve(v: &mut [f64]) -> Vec<(f64, f64)> {
    [0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0]
        .iter()
        .map(|p| (*p, percentile(v, *p)))
        .collect()
}

/// A one-line progress bar on stderr.
struct Progress {
    label: String,
    total: u64,
    shown: std::sync::atomic::AtomicU64,
    on: bool,
}

impl Progress {
    fn new(label: String, total: u64, on: bool) -> Arc<Progress> {
        let p = Arc::new(Progress {
            label,
            total: total.max(1),
            shown: Default::default(),
            on,
        });
        p.draw(0);
        p
    }

    fn draw(&self, done: u64) {
        if !self.on {
            return;
        }
        let pct = (done * 100 / self.total).min(100);
        let last = self.shown.load(std::sync::atomic::Ordering::Relaxed);
        if pct == last && done != 0 {
            return;
        }
        self.shown.store(pct, std::sync::atomic::Ordering::Relaxed);
        let filled = (pct as usize) / 4;
        eprint!(
            "\r{:<44} [{}{}] {pct:>3}%",
            self.label,
            "#".repeat(filled),
            ".".repeat(25 - filled)
        );
    }

    fn done(&self, note: &str) {
        if self.on {
            eprintln!("\r{:<44} [{}] {note}", self.label, "#".repeat(25));
        }
    }
}

/// Runs one cell against `driver`. `rate`: open-loop records per second.
async fn run_cell(
    driver: &dyn Driver,
    spec: &Spec,
    scale: Scale,
    rate: Option<f64>,
    progress: bool,
) -> anyhow::Result<Measured> {
    static UNIQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = UNIQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    run_cell_on(
        driver,
        spec,
        scale,
        rate,
        progress,
        format!("bench{}{n}", spec.id.to_lowercase()),
    )
    .await
}

async fn run_cell_on(
    driver: &dyn Driver,
    spec: &Spec,
    scale: Scale,
    rate: Option<f64>,
    progress: bool,
    stream: String,
) -> anyhow::Result<Measured> {
    driver.create(stream.clone()).await?;
    let latency_cell = spec.window == 1 && spec.producers == 1;
    let records_per_producer: u64 = if latency_cell {
        scale.samples() as u64
    } else {
        ((scale.records() as f64 * spec.share) as u64).max(spec.batch as u64 * 4)
    };
    let batches = records_per_producer.div_ceil(spec.batch as u64);
    let total = batches * spec.batch as u64 * spec.producers as u64;
    let bar = Progress::new(format!("{} {}", spec.id, driver.name()), total, progress);

    let mut consumers = Vec::new();
    for _ in 0..spec.fanout {
        consumers.push(driver.consumer(stream.clone()).await?);
    }
    // Let push consumers and subscriptions settle before the first record.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let collect_e2e = latency_cell || spec.open_of.is_some();
    let counters: Vec<_> = consumers
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                let mut got = 0u64;
                let mut last = Instant::now();
                let mut e2e = Vec::new();
                while got < total {
                    match tokio::time::timeout(Duration::from_secs(10), c.next()).await {
                        Ok(Ok(Some(stamps))) => {
                            got += stamps.len() as u64;
                            last = Instant::now();
                            if collect_e2e {
                                let now = stamp_now();
                                e2e.extend(
                                    stamps.iter().map(|s| now.saturating_sub(*s) as f64 / 1e3),
                                );
                            }
                        }
                        Ok(Ok(None)) | Err(_) => break,
                        Ok(Err(e)) => return Err(e),
                    }
                }
                Ok::<_, anyhow::Error>((got, last, e2e))
            })
        })
        .collect();

    let static_batch: Vec<Bytes> = (0..spec.batch).map(|_| stamped(spec.size, 0)).collect();
    let flushes_before = driver.flush_counts();
    let stages_before = driver.stage_buckets();
    let cpu_before = driver.server_cpu_ns();
    let started = Instant::now();
    let interval =
        rate.map(|r| Duration::from_secs_f64(spec.batch as f64 * spec.producers as f64 / r));
    let mut producers = Vec::new();
    for _ in 0..spec.producers {
        let mut p = driver.producer(stream.clone(), spec.window).await?;
        let (bar, static_batch) = (bar.clone(), static_batch.clone());
        let (size, batch) = (spec.size, spec.batch);
        producers.push(tokio::spawn(async move {
            for i in 0..batches {
                let intended = match interval {
                    Some(iv) => {
                        let due = started + iv * i as u32;
                        tokio::time::sleep_until(due.into()).await;
                        due
                    }
                    // Closed loop: stamped once the window lets the batch go.
                    None => {
                        p.room().await?;
                        Instant::now()
                    }
                };
                if collect_e2e {
                    let s = stamp_now();
                    let b: Vec<Bytes> = (0..batch).map(|_| stamped(size, s)).collect();
                    p.send(&b, intended).await?;
                } else {
                    p.send(&static_batch, intended).await?;
                }
                if i % 64 == 0 {
                    bar.draw(i * batch as u64);
                }
            }
            p.finish().await
        }));
    }
    let mut acks = Vec::new();
    for p in producers {
        acks.extend(p.await.context("producer task")??);
    }
    let acked_secs = started.elapsed().as_secs_f64();
    let mut delivered = 0u64;
    let mut last = started;
    let mut e2e = Vec::new();
    for c in counters {
        let (got, at, lat) = c.await.context("consumer task")??;
        delivered += got;
        last = last.max(at);
        e2e.extend(lat);
    }
    let server_cpu_us = match (cpu_before, driver.server_cpu_ns()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1e3 / total as f64),
        _ => None,
    };
    let expected = total * spec.fanout as u64;
    if delivered < expected {
        bar.done("FAILED");
        anyhow::bail!("lost {} of {expected} deliveries", expected - delivered);
    }
    let delivered_secs = last.duration_since(started).as_secs_f64().max(acked_secs);
    let appends_per_flush = match flushes_before {
        Some((s0, b0)) if spec.durable => {
            // The broker samples its logs' counters every 250 ms. A shard moving between
            // cores mid-cell (load following) can make a sample fall short for a moment:
            // then there is no ratio to report.
            tokio::time::sleep(Duration::from_millis(300)).await;
            driver.flush_counts().and_then(|(s1, b1)| {
                (s1 > s0 && b1 >= b0).then(|| (b1 - b0) as f64 / (s1 - s0) as f64)
            })
        }
        _ => None,
    };
    // The device stages are sampled every 250 ms (waited for above on durable cells).
    if !spec.durable && stages_before.is_some() {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let stages = match (stages_before, driver.stage_buckets()) {
        (Some(before), Some(after)) => before
            .iter()
            .zip(after)
            .filter_map(|((name, b), (_, a))| {
                let d: Vec<u64> = a.iter().zip(b).map(|(a, b)| a.saturating_sub(*b)).collect();
                Some((
                    *name,
                    crate::drivers::bucket_quantile(&d, 0.5)?,
                    crate::drivers::bucket_quantile(&d, 0.99)?,
                ))
            })
            .collect(),
        _ => Vec::new(),
    };
    let m = Measured {
        stages,
        appends_per_flush,
        server_cpu_us,
        acked_per_sec: total as f64 / acked_secs,
        mb_per_sec: total as f64 * spec.size as f64 / acked_secs / 1e6,
        delivered_per_sec: delivered as f64 / delivered_secs,
        ack: pcts(&mut acks),
        e2e: collect_e2e.then(|| pcts(&mut e2e)),
        curve: curve(&mut acks),
    };
    bar.done(&format!(
        "{:.0} msgs/s, ack p99 {:.0} us",
        m.acked_per_sec, m.ack[1]
    ));
    Ok(m)
}

/// The machine a run was on.
pub fn machine(dir: &std::path::Path) -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    let (f50, f99) = fsync_probe(dir).unwrap_or((0.0, 0.0));
    json!({
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu": cpu,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "fsync_4k_p50_us": f50,
        "fsync_4k_p99_us": f99,
    })
}

/// 4 KiB write + fdatasync, 200 times, in `dir`: the disk's durable-write floor.
fn fsync_probe(dir: &std::path::Path) -> anyhow::Result<(f64, f64)> {
    use std::io::Write;
    use std::os::unix::io::AsRawFd;
    let path = dir.join("fsync-probe");
    let mut f = std::fs::File::create(&path)?;
    let block = vec![0x33u8; 4096];
    let mut lat = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = Instant::now();
        f.write_all(&block)?;
        // SAFETY: fdatasync on a file descriptor this function owns.
        let rc = unsafe { libc::fdatasync(f.as_raw_fd()) };
        anyhow::ensure!(rc == 0, "fdatasync failed");
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let _ = std::fs::remove_file(&path);
    Ok((percentile(&mut lat, 0.5), percentile(&mut lat, 0.99)))
}

/// One broker's results, by scenario id.
type Results = Vec<(String, String, Result<Measured, String>)>;

fn drivers_for(
    peer: Peer,
    durable: bool,
    bins: Option<&PeerBinaries>,
    cores: &str,
    confine_peers_to: Option<&[usize]>,
) -> anyhow::Result<(Box<dyn Driver>, Box<dyn std::any::Any>)> {
    let confined = |p: peers::PeerProcess| -> anyhow::Result<peers::PeerProcess> {
        if let Some(cpus) = confine_peers_to {
            confine_process(p.pid(), cpus)?;
        }
        Ok(p)
    };
    Ok(match peer {
        Peer::Felix => {
            let b = LocalBroker::start(Some(cores), if durable { "on-commit" } else { "none" })?;
            if let Some(cpus) = confine_peers_to {
                confine_ours(b.link().pid(), cpus)?;
            }
            (
                Box::new(FelixDriver {
                    target: b.target.clone(),
                    broker: Some(b.link()),
                }),
                Box::new(b),
            )
        }
        Peer::Nats => {
            let p = confined(peers::start_nats(
                &bins.context("peer binaries")?.nats,
                durable,
            )?)?;
            (
                Box::new(NatsDriver {
                    addr: p.addr,
                    pid: Some(p.pid()),
                }),
                Box::new(p),
            )
        }
        Peer::Redis => {
            let p = confined(peers::start_redis(
                &bins.context("peer binaries")?.redis,
                durable,
            )?)?;
            (
                Box::new(RedisDriver {
                    addr: p.addr,
                    pid: Some(p.pid()),
                }),
                Box::new(p),
            )
        }
    })
}

/// Runs the matrix; writes `results.json`, `results.md` and SVG plots under `out`.
/// Returns the Markdown.
pub fn run(opts: &Options) -> anyhow::Result<String> {
    std::fs::create_dir_all(&opts.out)?;
    let bins = if opts.peers.iter().any(|p| *p != Peer::Felix) {
        Some(PeerBinaries::install()?)
    } else {
        None
    };
    let load_cpus = opts.load_cores.as_deref().map(parse_cpus).transpose()?;
    let broker_cpus = match &load_cpus {
        Some(_) => Some(parse_cpus(&opts.cores)?),
        None => None,
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(2).enable_all();
    if let Some(cpus) = load_cpus.clone() {
        // The load runs in spawned tasks, on the runtime's workers; this thread only
        // waits (and starts our broker, whose cores pin themselves to `cores`).
        builder.on_thread_start(move || {
            let _ = confine(0, &cpus);
        });
    }
    let rt = builder.build()?;
    let scratch = tempfile::Builder::new()
        .prefix("felix-bench-probe")
        .tempdir_in("/var/tmp")?;
    let mut machine = machine(scratch.path());
    // Rounds repeat the whole matrix, peer after peer, so every broker sees the same
    // spread of machine noise; each cell reports its median round.
    let mut rounds: Vec<Results> = Vec::new();
    for round in 0..opts.rounds.max(1) {
        if opts.progress && opts.rounds > 1 {
            eprintln!("round {} of {}", round + 1, opts.rounds);
        }
        let mut results: Results = Vec::new();
        for &peer in &opts.peers {
            for durable in [false, true] {
                let (driver, guard) = drivers_for(
                    peer,
                    durable,
                    bins.as_ref(),
                    &opts.cores,
                    broker_cpus.as_deref(),
                )?;
                let driver: Arc<dyn Driver> = Arc::from(driver);
                rt.block_on(async {
                    // Warm-up: connections, first stream, first file; not reported.
                    let warm = Spec {
                        id: "warmup",
                        what: "",
                        size: 1024,
                        batch: 16,
                        fanout: 1,
                        producers: 1,
                        durable,
                        window: 16,
                        share: 0.05,
                        open_of: None,
                    };
                    if let Err(e) = run_cell(driver.as_ref(), &warm, opts.scale, None, false).await
                    {
                        eprintln!("warm-up on {} failed: {e:#}", driver.name());
                    }
                    let wanted =
                        |s: &&Spec| opts.only.is_empty() || opts.only.iter().any(|o| o == s.id);
                    for spec in SPECS.iter().filter(|s| s.durable == durable).filter(wanted) {
                        let rate = match spec.open_of {
                            None => None,
                            Some((of, fraction)) => results
                                .iter()
                                .find(|(id, d, r)| id == of && d == driver.name() && r.is_ok())
                                .and_then(|(_, _, r)| r.as_ref().ok())
                                .map(|m| m.acked_per_sec * fraction),
                        };
                        if spec.open_of.is_some() && rate.is_none() {
                            results.push((
                                spec.id.into(),
                                driver.name().into(),
                                Err("no maximum to take a fraction of".into()),
                            ));
                            continue;
                        }
                        let r =
                            run_cell(driver.as_ref(), spec, opts.scale, rate, opts.progress).await;
                        results.push((
                            spec.id.into(),
                            driver.name().into(),
                            r.map_err(|e| format!("{e:#}")),
                        ));
                    }
                });
                drop(guard);
            }
        }
        rounds.push(results);
    }
    let results = median_rounds(rounds);
    // Ours only: scaling (S13), pinning sweep, recovery (S14).
    let mut extra = serde_json::Map::new();
    // All of them without `--only`; otherwise those it names (`--only pinning`).
    let wanted = |id: &str| opts.only.is_empty() || opts.only.iter().any(|o| o == id);
    if opts.peers.contains(&Peer::Felix) {
        let or_error =
            |r: anyhow::Result<Value>| r.unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        if wanted("S13") {
            extra.insert("S13".into(), or_error(rt.block_on(scaling(opts))));
        }
        if wanted("pinning") {
            extra.insert("pinning".into(), or_error(rt.block_on(pinning(opts))));
        }
        if wanted("S14") {
            extra.insert("S14".into(), or_error(recovery(opts, &rt)));
        }
        if wanted("S11") {
            extra.insert("S11".into(), or_error(transport(opts)));
        }
    }
    machine["scale"] = json!(format!("{:?}", opts.scale).to_lowercase());
    machine["felix_cores"] = json!(opts.cores);
    machine["load_cores"] = json!(opts.load_cores);
    let report = crate::report::Report {
        machine,
        specs: SPECS
            .iter()
            .filter(|s| opts.only.is_empty() || opts.only.iter().any(|o| o == s.id))
            .map(|s| (s.id, s.what, s.durable))
            .collect(),
        results,
        extra,
    };
    let md = report.markdown();
    std::fs::write(opts.out.join("results.md"), &md)?;
    std::fs::write(
        opts.out.join("results.json"),
        serde_json::to_string_pretty(&report.json())?,
    )?;
    std::fs::write(opts.out.join("throughput.svg"), report.throughput_svg())?;
    std::fs::write(opts.out.join("latency.svg"), report.latency_svg())?;
    if report.failures() > 0 {
        anyhow::bail!(
            "{} cells failed; see {}",
            report.failures(),
            opts.out.join("results.md").display()
        );
    }
    Ok(md)
}

/// Per cell, the round with the median headline; a cell that failed in any round is
/// reported failed (loss is never averaged away).
fn median_rounds(mut rounds: Vec<Results>) -> Results {
    let first = rounds.remove(0);
    first
        .into_iter()
        .map(|(id, broker, r)| {
            let mut all = vec![r];
            for round in &rounds {
                if let Some((_, _, r)) = round.iter().find(|(i, b, _)| *i == id && *b == broker) {
                    all.push(r.clone());
                }
            }
            if let Some(e) = all.iter().find_map(|r| r.as_ref().err()) {
                return (id, broker, Err(e.clone()));
            }
            let mut ok: Vec<Measured> = all.into_iter().filter_map(Result::ok).collect();
            let key = |m: &Measured| crate::report::headline_of(&id, m);
            ok.sort_by(|a, b| key(a).partial_cmp(&key(b)).expect("no NaN"));
            let mid = ok.swap_remove(ok.len() / 2);
            (id, broker, Ok(mid))
        })
        .collect()
}

/// S13: S3's load with 2 producers on 2 streams, broker on 1 core vs 2 cores.
async fn scaling(opts: &Options) -> anyhow::Result<Value> {
    let spec = Spec {
        id: "S13",
        what: "",
        size: 1024,
        batch: 64,
        fanout: 0,
        producers: 1,
        durable: false,
        window: 64,
        share: 0.5,
        open_of: None,
    };
    let mut out = serde_json::Map::new();
    for cores in ["0", "0-1"] {
        let b = LocalBroker::start(Some(cores), "none")?;
        let d = FelixDriver {
            target: b.target.clone(),
            broker: Some(b.link()),
        };
        let (a, c) = tokio::join!(
            run_cell(&d, &spec, opts.scale, None, false),
            run_cell(&d, &spec, opts.scale, None, false)
        );
        let total = a?.acked_per_sec + c?.acked_per_sec;
        out.insert(format!("cores_{cores}"), json!(total));
        b.stop()?;
    }
    let one = out["cores_0"].as_f64().unwrap_or(0.0);
    let two = out["cores_0-1"].as_f64().unwrap_or(0.0);
    out.insert(
        "ratio".into(),
        json!(if one > 0.0 { two / one } else { 0.0 }),
    );
    Ok(Value::Object(out))
}

/// What a pinning table changes: two hot streams on the same core vs apart.
async fn pinning(opts: &Options) -> anyhow::Result<Value> {
    let spec = Spec {
        id: "pin",
        what: "",
        size: 1024,
        batch: 64,
        fanout: 0,
        producers: 1,
        durable: false,
        window: 64,
        share: 0.5,
        open_of: None,
    };
    let mut out = serde_json::Map::new();
    // Streams are named benchpin<N>: pin by wildcard on the name prefix is not a rule
    // shape, so pin the whole tenant (both streams) to core 0, or leave the hash.
    for (label, pins) in [
        ("hashed", vec![]),
        ("all_on_core_0", vec!["dev/*/*/*=0".to_owned()]),
    ] {
        let b = LocalBroker::start_with(Some(&opts.cores), "none", &pins, None)?;
        let d = FelixDriver {
            target: b.target.clone(),
            broker: Some(b.link()),
        };
        let (a, c) = tokio::join!(
            run_cell(&d, &spec, opts.scale, None, false),
            run_cell(&d, &spec, opts.scale, None, false)
        );
        out.insert(label.into(), json!(a?.acked_per_sec + c?.acked_per_sec));
        b.stop()?;
    }
    out.insert("live_repin".into(), live_repin(opts).await?);
    Ok(Value::Object(out))
}

/// Two streams under load on core 0; halfway through, one is re-pinned live to core 1
/// (`POST /pins`). Throughput before and after, ack p99 before and while it moves.
async fn live_repin(opts: &Options) -> anyhow::Result<Value> {
    let cores = &opts.cores;
    if !cores.contains('-') && !cores.contains(',') {
        return Ok(json!({"skipped": "needs two cores (--cores 0-1)"}));
    }
    let half = match opts.scale {
        Scale::Tiny => Duration::from_millis(500),
        Scale::Small => Duration::from_secs(2),
        Scale::Full => Duration::from_secs(5),
    };
    let b = LocalBroker::start_with(Some(cores), "none", &["dev/*/*/*=0".to_owned()], None)?;
    let http = b.http.context("the bench broker serves HTTP")?;
    let d = FelixDriver {
        target: b.target.clone(),
        broker: Some(b.link()),
    };
    let start = Instant::now();
    let end = start + half * 2;
    let load = |stream: &'static str| {
        let d = d.clone();
        async move {
            d.create(stream.into()).await?;
            let mut p = d.producer(stream.into(), 64).await?;
            let batch: Vec<Bytes> = (0..64).map(|_| stamped(1024, 0)).collect();
            let mut sent = Vec::new();
            while Instant::now() < end {
                p.room().await?;
                let t = Instant::now();
                p.send(&batch, t).await?;
                sent.push(t);
            }
            let lat = p.finish().await?;
            anyhow::Ok(sent.into_iter().zip(lat).collect::<Vec<(Instant, f64)>>())
        }
    };
    let mover = async {
        tokio::time::sleep_until((start + half).into()).await;
        let began = Instant::now();
        let answer = tokio::task::spawn_blocking(move || {
            felix_client::ops::http(
                &http.to_string(),
                "POST",
                "/pins",
                Some(r#"{"rule": "dev/default/benchlive1/0=1"}"#),
            )
        })
        .await?
        .map_err(|e| anyhow::anyhow!(e))?;
        anyhow::ensure!(answer.0 == 200, "re-pin refused: {answer:?}");
        let report: Value = serde_json::from_str(&answer.1)?;
        anyhow::Ok((began, Instant::now(), report))
    };
    let (a, c, moved) = tokio::join!(load("benchlive0"), load("benchlive1"), mover);
    b.stop()?;
    let (began, done, report) = moved?;
    let acks: Vec<(Instant, f64)> = a?.into_iter().chain(c?).collect();
    // Steady windows leave out the first quarter (warm-up) and the move itself.
    let rate = |from: Instant, to: Instant| {
        let n = acks.iter().filter(|(t, _)| *t >= from && *t < to).count();
        n as f64 * 64.0 / (to - from).as_secs_f64()
    };
    let p99 = |from: Instant, to: Instant| {
        let mut v: Vec<f64> = acks
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, l)| *l)
            .collect();
        percentile(&mut v, 0.99)
    };
    let settle = Duration::from_millis(100);
    Ok(json!({
        "before_msgs_per_sec": rate(start + half / 4, began),
        "after_msgs_per_sec": rate(done + settle, end),
        "before_p99_us": p99(start + half / 4, began),
        "during_move_p99_us": p99(began - settle, done + settle),
        "move_ms": (done - began).as_secs_f64() * 1e3,
        "hold_ms": report["hold_ms"],
        "flush_ms": report["flush_ms"],
        "release_ms": report["release_ms"],
        "take_ms": report["take_ms"],
    }))
}

/// S14: write a durable log, stop, restart over it, and time reopening the shard.
fn recovery(opts: &Options, rt: &tokio::runtime::Runtime) -> anyhow::Result<Value> {
    let spec = Spec {
        id: "S14",
        what: "",
        size: 4096,
        batch: 64,
        fanout: 0,
        producers: 1,
        durable: true,
        window: 32,
        share: 1.0,
        open_of: None,
    };
    let b = LocalBroker::start(Some(&opts.cores), "on-commit")?;
    let d = FelixDriver {
        target: b.target.clone(),
        broker: Some(b.link()),
    };
    rt.block_on(run_cell_on(
        &d,
        &spec,
        opts.scale,
        None,
        false,
        "benchrecovery".into(),
    ))?;
    let dir = b.stop_keep()?;
    let bytes = dir_bytes(&dir.path().join("data/streams"));
    let t = Instant::now();
    let b = LocalBroker::start_with(Some(&opts.cores), "on-commit", &[], Some(dir))?;
    // The shard's log is opened (and recovered) on first use: a consumer attach.
    let d = FelixDriver {
        target: b.target.clone(),
        broker: Some(b.link()),
    };
    rt.block_on(async {
        d.consumer("benchrecovery".into()).await?;
        anyhow::Ok(())
    })?;
    let secs = t.elapsed().as_secs_f64();
    b.stop()?;
    Ok(json!({"bytes": bytes, "seconds": secs, "mb_per_sec": bytes as f64 / secs / 1e6}))
}

/// S11: the raw QUIC transport ceiling — one connection, 64 KiB writes, client to server
/// (counted by an echo-free sink) and server to client, on our driver (1 core) and on
/// quinn/tokio (1 worker), same client; and the 64 B echo RTT the S1 latency targets
/// are judged against. With `--load-cores`, each server (ours, quinn/tokio) runs on the
/// first of `--cores` and the client on the load cores, as the broker and the load
/// generator do in S1.
fn transport(opts: &Options) -> anyhow::Result<Value> {
    use crate::quic::{Certs, Client, Direction, start_ours, start_ours_on, start_quinn_on};
    let bytes: u64 = match opts.scale {
        Scale::Tiny => 8 << 20,
        Scale::Small => 256 << 20,
        Scale::Full => 1 << 30,
    };
    let certs = Certs::new()?;
    let placed = match opts.load_cores.as_deref() {
        Some(load) => Some((parse_cpus(&opts.cores)?, parse_cpus(load)?)),
        None => None,
    };
    let client = Client::new_on(&certs, 1, placed.as_ref().map(|(_, load)| load.clone()))?;
    let down = |server: &dyn crate::quic::Server| -> anyhow::Result<f64> {
        Ok(client
            .transfer(server, Direction::Download, 1, bytes)?
            .mb_per_sec)
    };
    let ours = match &placed {
        Some((cores, _)) => start_ours_on(&certs, cores[..1].to_vec(), None)?,
        None => start_ours(&certs, 1)?,
    };
    let ours_mb = client.throughput(&*ours, 1, bytes)?;
    let ours_down = down(&*ours)?;
    // Enough samples for a p99 the S1 target can be judged against (S1 has thousands).
    let mut rtt = client.rtt(ours.addr(), 5000)?;
    ours.stop();
    let quinn = start_quinn_on(
        &certs,
        1,
        placed.as_ref().map(|(cores, _)| cores[..1].to_vec()),
    )?;
    let quinn_mb = client.throughput(&*quinn, 1, bytes)?;
    let quinn_down = down(&*quinn)?;
    quinn.stop();
    Ok(json!({
        "felix_mb_per_sec": ours_mb,
        "quinn_mb_per_sec": quinn_mb,
        "ratio": ours_mb / quinn_mb,
        "felix_download_mb_per_sec": ours_down,
        "quinn_download_mb_per_sec": quinn_down,
        "download_ratio": ours_down / quinn_down,
        "felix_rtt_p50_us": percentile(&mut rtt, 0.5),
        "felix_rtt_p99_us": percentile(&mut rtt, 0.99),
    }))
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Per-core scaling, ours alone: S3's load (1 KiB records, batches of 64, 64 batches in
/// flight) from `per_core` producers per broker core, each on its own stream pinned to
/// that core, for each core count in `counts`. The broker runs on CPUs `0..n`, the load
/// generator on `load_cores` (which must not overlap them). Reports the median round's
/// msgs/s per count, per core, against `n` times one core's, and how busy the broker's
/// cores were (their threads' CPU time over the cell's wall time).
pub fn scaling_curve(
    counts: &[usize],
    load_cores: &str,
    per_core: usize,
    records: u64,
    rounds: usize,
    fsync: &str,
) -> anyhow::Result<String> {
    let load = parse_cpus(load_cores)?;
    anyhow::ensure!(
        counts
            .iter()
            .all(|&n| n >= 1 && !load.iter().any(|&c| c < n)),
        "the load's CPUs ({load_cores}) overlap the broker's (0..{})",
        counts.iter().max().copied().unwrap_or(1)
    );
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(load.len()).enable_all();
    let confined = load.clone();
    builder.on_thread_start(move || {
        let _ = confine(0, &confined);
    });
    let rt = builder.build()?;
    let spec = Spec {
        id: "scale",
        what: "",
        size: 1024,
        batch: 64,
        fanout: 0,
        producers: 1,
        durable: fsync != "none",
        window: 64,
        share: records as f64 / Scale::Full.records() as f64,
        open_of: None,
    };
    let mut rows = Vec::new();
    for &n in counts {
        let cores = if n == 1 {
            "0".to_owned()
        } else {
            format!("0-{}", n - 1)
        };
        let mut runs: Vec<(f64, f64)> = Vec::new();
        for round in 0..rounds.max(1) {
            let name = |core: usize, p: usize| format!("scale{n}r{round}c{core}p{p}");
            let pins: Vec<String> = (0..n)
                .flat_map(|core| (0..per_core).map(move |p| (core, p)))
                .map(|(core, p)| format!("dev/*/{}/*={core}", name(core, p)))
                .collect();
            let b = LocalBroker::start_with(Some(&cores), fsync, &pins, None)?;
            let d = FelixDriver {
                target: b.target.clone(),
                broker: Some(b.link()),
            };
            let cpu_before = d.server_cpu_ns();
            let started = Instant::now();
            let total = rt.block_on(async {
                let cells: Vec<_> = (0..n)
                    .flat_map(|core| (0..per_core).map(move |p| (core, p)))
                    .map(|(core, p)| {
                        let (d, stream) = (d.clone(), name(core, p));
                        tokio::spawn(async move {
                            run_cell_on(&d, &spec, Scale::Full, None, false, stream).await
                        })
                    })
                    .collect();
                let mut total = 0.0;
                for c in cells {
                    total += c.await??.acked_per_sec;
                }
                Ok::<_, anyhow::Error>(total)
            })?;
            let wall = started.elapsed().as_nanos() as f64;
            let busy = match (cpu_before, d.server_cpu_ns()) {
                (Some(a), Some(z)) => (z - a) as f64 / wall / n as f64,
                _ => f64::NAN,
            };
            eprintln!(
                "cores {n} round {round}: {total:.0} msgs/s, broker cores {:.0}% busy",
                busy * 100.0
            );
            runs.push((total, busy));
            b.stop()?;
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        rows.push((n, runs[runs.len() / 2]));
    }
    let one = rows
        .iter()
        .find(|(n, _)| *n == 1)
        .map(|(_, (r, _))| *r)
        .filter(|r| *r > 0.0);
    let mut md = String::from(
        "| broker cores | msgs/s | per core | vs n x one core | broker cores busy |\n|---|---|---|---|---|\n",
    );
    for (n, (rate, busy)) in &rows {
        let vs = one.map_or("-".to_owned(), |o| {
            format!("{:.2}x", rate / (o * *n as f64))
        });
        md.push_str(&format!(
            "| {n} | {rate:.0} | {:.0} | {vs} | {:.0}% |\n",
            rate / *n as f64,
            busy * 100.0
        ));
    }
    md.push_str(&format!(
        "(median of {} rounds; {per_core} producer(s) per core, each on a stream pinned to it; \
         {records} records per producer; fsync {fsync}; load on CPUs {load_cores})",
        rounds.max(1)
    ));
    Ok(md)
}
