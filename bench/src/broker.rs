//! Broker throughput and latency, with our wire-level load client (see [`crate::client`]).
//!
//! Starts `felix-broker dev` in a process of its own ([`LocalBroker`]) on a temporary
//! data directory, then for each cell: opens `fanout` subscribers, publishes 1 KiB
//! records in batches of `batch` for a fixed time from one pipelined stream per
//! publisher, and counts acknowledged and delivered records. Latency: one publisher, one record per batch, one at a time
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

/// Our broker in a process of its own, as each peer runs and as it runs in production.
///
/// It is this executable again (`felix-bench serve-broker`, see [`serve_child`]), not a
/// thread of the load's process: glommio's park issues a private expedited
/// `membarrier()`, which interrupts every CPU running a thread of the process, so a
/// broker sharing the load generator's process would interrupt the load's CPUs on every
/// park and be charged for waiting on them. The parent asks it for its metrics over the
/// child's stdin and stdout ([`BrokerLink`]); closing its stdin stops it.
pub struct LocalBroker {
    child: Option<std::process::Child>,
    link: std::sync::Arc<BrokerLink>,
    dir: Option<tempfile::TempDir>,
    /// How to reach it.
    pub target: Target,
    /// Its operator HTTP endpoint (`/pins`, `/cores`).
    pub http: Option<std::net::SocketAddr>,
}

impl std::fmt::Debug for LocalBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBroker")
            .field("addr", &self.target.addr)
            .field("pid", &self.link.pid)
            .finish()
    }
}

/// What the bench asks a [`LocalBroker`]'s process: its metrics and placement.
pub struct BrokerLink {
    pid: u32,
    io: std::sync::Mutex<(
        Option<std::process::ChildStdin>,
        std::io::BufReader<std::process::ChildStdout>,
    )>,
}

impl std::fmt::Debug for BrokerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerLink")
            .field("pid", &self.pid)
            .finish()
    }
}

impl BrokerLink {
    /// Sends one question line; the answer is one JSON line.
    fn ask(&self, question: &str) -> anyhow::Result<serde_json::Value> {
        use std::io::{BufRead, Write};
        let mut io = self
            .io
            .lock()
            .map_err(|_| anyhow::anyhow!("a panicked asker"))?;
        let (stdin, stdout) = &mut *io;
        let stdin = stdin
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the broker is stopping"))?;
        writeln!(stdin, "{question}")?;
        stdin.flush()?;
        let mut line = String::new();
        if stdout.read_line(&mut line)? == 0 {
            anyhow::bail!("the broker process exited");
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// The broker process's id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// CPU time (ns) of every thread of the broker's process (as each peer's is
    /// counted): its cores, the io_uring workers they start, its control threads.
    pub fn cpu_ns(&self) -> Option<u64> {
        crate::drivers::threads_cpu_ns(&self.pid.to_string(), |_| true)
    }

    /// Per-stage latency histograms, all cores summed, in [`crate::drivers::STAGES`]'s
    /// order.
    pub fn stage_buckets(&self) -> Option<Vec<Vec<u64>>> {
        serde_json::from_value(self.ask("stages").ok()?).ok()
    }

    /// Durable flushes so far and the batches they covered.
    pub fn flush_counts(&self) -> Option<(u64, u64)> {
        serde_json::from_value(self.ask("flushes").ok()?).ok()
    }

    /// Connections accepted so far, per core.
    pub fn connections(&self) -> anyhow::Result<Vec<u64>> {
        Ok(serde_json::from_value(self.ask("connections")?)?)
    }

    /// The core that owns shard 0 of cache `name` in namespace `default`.
    pub fn cache_core(&self, name: &str) -> anyhow::Result<usize> {
        Ok(serde_json::from_value(
            self.ask(&format!("cache-core {name}"))?,
        )?)
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
        let mut args: Vec<std::ffi::OsString> = vec![
            "serve-broker".into(),
            "--fsync".into(),
            fsync.into(),
            "--dir".into(),
            dir.path().into(),
        ];
        if let Some(c) = cores {
            args.extend(["--cores".into(), c.into()]);
        }
        for p in pins {
            args.extend(["--pin".into(), p.into()]);
        }
        let (child, stdin, stdout, started) = spawn_self::<Started>(&args)?;
        let link = std::sync::Arc::new(BrokerLink {
            pid: child.id(),
            io: std::sync::Mutex::new((Some(stdin), stdout)),
        });
        Ok(LocalBroker {
            child: Some(child),
            link,
            dir: Some(dir),
            target: Target {
                addr: started.addr,
                ca_pem: started.ca_pem,
                tenant: "dev".into(),
                token: started.token,
            },
            http: started.http,
        })
    }

    /// Stops it.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.shut()
    }

    /// Stops it and keeps its data directory (for a restart over it).
    pub fn stop_keep(mut self) -> anyhow::Result<tempfile::TempDir> {
        self.shut()?;
        self.dir
            .take()
            .ok_or_else(|| anyhow::anyhow!("no data directory"))
    }

    /// Closes the child's stdin (its signal to shut down) and waits for it ([`reap`]).
    fn shut(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        self.link
            .io
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0 = None;
        reap(&mut child, "the broker process")
    }

    /// What the bench asks its process.
    pub fn link(&self) -> std::sync::Arc<BrokerLink> {
        self.link.clone()
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.target.addr
    }
}

impl Drop for LocalBroker {
    fn drop(&mut self) {
        let _ = self.shut();
    }
}

/// How long a stopping child process may take before it is killed.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// A child of this executable (or the one [`use_executable`] named) serving a hidden
/// subcommand: `args`, stdin and stdout piped, stderr shared. Returns it once it has
/// printed its first line, the JSON `T` saying where it serves; a child that exits or
/// prints something else first is killed and reaped.
pub(crate) fn spawn_self<T: serde::de::DeserializeOwned>(
    args: &[std::ffi::OsString],
) -> anyhow::Result<(
    std::process::Child,
    std::process::ChildStdin,
    std::io::BufReader<std::process::ChildStdout>,
    T,
)> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let exe = match EXECUTABLE.get() {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdin = child.stdin.take().expect("piped");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    let started = match stdout.read_line(&mut line) {
        Ok(0) => Err(anyhow::anyhow!(
            "`felix-bench {}` exited before serving",
            args.first().map_or("".into(), |a| a.to_string_lossy())
        )),
        Ok(_) => serde_json::from_str::<T>(&line).map_err(anyhow::Error::from),
        Err(e) => Err(e.into()),
    };
    match started {
        Ok(s) => Ok((child, stdin, stdout, s)),
        Err(e) => {
            // Not left running (or unreaped), over a directory about to go perhaps.
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        }
    }
}

/// Waits for `child`, whose stdin was closed (its signal to stop), at most
/// [`STOP_WAIT`]; then kills it. An unclean exit is an error naming `what`.
pub(crate) fn reap(child: &mut std::process::Child, what: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + STOP_WAIT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let status = child.wait()?;
            anyhow::bail!("{what} did not stop within {STOP_WAIT:?}: {status}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    anyhow::ensure!(status.success(), "{what} ended with {status}");
    Ok(())
}

/// The executable that serves `serve-broker`, when this one does not (a test binary).
static EXECUTABLE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Runs each [`LocalBroker`] and our QUIC echo server ([`crate::quic::start_ours`]) from
/// `exe` (`felix-bench`) instead of this executable: for tests, whose binary is the test
/// harness (`env!("CARGO_BIN_EXE_felix-bench")`).
pub fn use_executable(exe: impl Into<std::path::PathBuf>) {
    let _ = EXECUTABLE.set(exe.into());
}

/// The line a broker process prints once it listens.
#[derive(serde::Serialize, serde::Deserialize)]
struct Started {
    addr: SocketAddr,
    http: Option<SocketAddr>,
    ca_pem: String,
    token: String,
}

/// The broker process's side (`felix-bench serve-broker`): starts `felix-broker dev` on
/// `dir` with `cores`, `fsync` and `pins`, prints where it listens as one JSON line, then
/// answers each question line on stdin (`stages`, `flushes`, `connections`,
/// `cache-core <name>`) with one JSON line until stdin closes, and stops.
pub fn serve_child(
    cores: Option<&str>,
    fsync: &str,
    pins: &[String],
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};
    use std::sync::atomic::Ordering;
    // The parent may run on the load's CPUs: this process's threads other than the
    // cores (which pin themselves) may use any.
    unpin_self();
    let config = BrokerConfig::resolve(
        FileConfig {
            pins: pins.to_vec(),
            ..FileConfig::default()
        },
        Overrides {
            listen: Some("127.0.0.1:0".into()),
            http: Some("127.0.0.1:0".into()),
            data_dir: Some(dir.join("data")),
            cores: cores.map(str::to_owned),
            fsync: Some(fsync.into()),
            default_shards: Some(1),
            ..Overrides::default()
        },
        true,
    )?;
    let setup = felix_broker::dev::prepare(&config.data_dir, "dev")?;
    let broker =
        felix_broker::server::start(&config, &setup.cert_pem, &setup.key_pem, setup.keys.clone())?;
    let shared = broker.shared.clone();
    // Locked per line, never across the wait for a question: a thread of the broker
    // printing meanwhile would otherwise block on it.
    let answer_line = |line: String| -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
        Ok(())
    };
    let started = Started {
        addr: broker.started.listen,
        http: broker.started.http,
        ca_pem: std::fs::read_to_string(&setup.ca_path)?,
        token: setup.token.clone(),
    };
    answer_line(serde_json::to_string(&started)?)?;
    type Pick = fn(&felix_broker::core::CoreMetrics) -> &felix_broker::histogram::Histogram;
    let picks: [Pick; 6] = [
        |m| &m.mesh_hop,
        |m| &m.append_commit,
        |m| &m.log_write,
        |m| &m.log_fsync,
        |m| &m.publish_ack,
        |m| &m.answer_send,
    ];
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let answer = match line.split_once(' ').unwrap_or((&line, "")) {
            ("stages", _) => serde_json::json!(
                picks
                    .iter()
                    .map(|pick| {
                        let mut sum = vec![0u64; felix_broker::histogram::BOUNDS_US.len() + 1];
                        for m in &shared.metrics {
                            for (s, c) in sum.iter_mut().zip(pick(m).buckets()) {
                                *s += c;
                            }
                        }
                        sum
                    })
                    .collect::<Vec<_>>()
            ),
            ("flushes", _) => serde_json::json!(shared.metrics.iter().fold((0, 0), |(s, b), m| {
                (
                    s + m.log_syncs.load(Ordering::Relaxed),
                    b + m.log_synced_batches.load(Ordering::Relaxed),
                )
            })),
            ("connections", _) => serde_json::json!(
                shared
                    .metrics
                    .iter()
                    .map(|m| m.connections.load(Ordering::Relaxed))
                    .collect::<Vec<_>>()
            ),
            ("cache-core", name) => {
                let key = felix_core_runtime::placement::ShardKey {
                    kind: felix_core_runtime::placement::ShardKind::Cache,
                    tenant: "dev".into(),
                    namespace: "default".into(),
                    name: name.into(),
                    shard: 0,
                };
                serde_json::json!(shared.placement.core_for(&key).index())
            }
            (other, _) => anyhow::bail!("an unknown question: {other}"),
        };
        answer_line(answer.to_string())?;
    }
    broker.shutdown()?;
    Ok(())
}

/// Lets this thread (and the threads it starts) run on every CPU.
pub(crate) fn unpin_self() {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls only read it.
    unsafe {
        // Every bit: the kernel keeps the CPUs that exist (numbering may have gaps).
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 0..libc::CPU_SETSIZE as usize {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
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
