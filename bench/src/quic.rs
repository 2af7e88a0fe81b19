//! QUIC transport benchmark: our glommio + quinn-proto driver against a plain quinn/tokio
//! server built the same way (same TLS, same transport limits, same echo service), with
//! the same quinn/tokio client driving both, in one run.
//!
//! - RTT: one connection, one bidirectional stream, 64 B written and read back, repeated.
//! - Upload: one connection, one unidirectional stream, 64 KiB client writes; the server
//!   counts the bytes and answers the count when the stream ends.
//! - Download: one connection; the client asks for N bytes and the server writes them as
//!   64 KiB chunks on a stream it opens. The server is the sender, the heavier side of
//!   QUIC (packet building, loss detection, congestion control, encryption), so this is
//!   the direction where the server rather than the client sets the pace.
//! - Scaling: our driver on 1 core and on 2 cores (SO_REUSEPORT), 2 connections.
//!
//! Every transfer also reports the CPU time the server's threads and the client's threads
//! spent on it (from `/proc/<pid>/task/*/schedstat`), so the cost per byte of each server
//! is measured even when the client, sharing a small machine, is what limits the rate.
//! Our server runs in a process of its own (`felix-bench serve-echo`, see
//! [`serve_echo_child`]), as our broker does; the quinn/tokio server on a runtime of the
//! bench's process.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use felix_core_runtime::CoreSet;
use felix_core_runtime::quic::{self, Connection, Endpoint, EndpointOptions, TransportLimits};
use felix_core_runtime::runtime::{Runtime, RuntimeConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::stats::{median, percentile};

/// Bytes per write in the throughput runs.
const CHUNK: usize = 64 * 1024;
/// First byte of a unidirectional stream: the client uploads; anything else asks the
/// server for the byte count that follows.
const UPLOAD: u8 = b'U';
const DOWNLOAD: u8 = b'D';

/// Thread-name prefixes the CPU accounting groups by (our server's threads are those of
/// its process).
const QUINN_THREADS: &str = "quinn-server";
const CLIENT_THREADS: &str = "bench-client";

/// Concurrency of the loaded echo run.
const LOADED_CONNECTIONS: usize = 4;
const LOADED_STREAMS: usize = 64;

/// Busy-poll time of the spinning variant in the RTT table.
const SPIN: Duration = Duration::from_micros(100);

/// TLS material shared by every server in a run.
#[derive(Debug, Clone)]
pub struct Certs(pub Arc<quic::GeneratedCerts>);

impl Certs {
    /// Fresh certificates for `localhost`.
    pub fn new() -> anyhow::Result<Certs> {
        Ok(Certs(Arc::new(quic::generate_certs(&["localhost"])?)))
    }

    fn ca(&self) -> CertificateDer<'static> {
        self.0.ca_der.clone()
    }
}

/// A running server.
pub trait Server {
    /// Where it listens.
    fn addr(&self) -> SocketAddr;
    /// CPU time (ns) its threads have used so far.
    fn cpu_ns(&self) -> u64;
    /// Stops it.
    fn stop(self: Box<Self>);
}

async fn serve_ours(conn: Connection) {
    loop {
        let bi = conn.accept_bi();
        let uni = conn.accept_uni();
        let next =
            futures_lite::future::or(async { bi.await.map(Ok) }, async { uni.await.map(Err) })
                .await;
        match next {
            Ok(Ok((mut send, mut recv))) => {
                felix_core_runtime::task::spawn(async move {
                    while let Ok(Some(chunk)) = recv.read_chunk(64 * 1024).await {
                        if send.write_chunk(chunk).await.is_err() {
                            return;
                        }
                    }
                    let _ = send.finish();
                })
                .detach();
            }
            Ok(Err(mut recv)) => {
                let conn = conn.clone();
                felix_core_runtime::task::spawn(async move {
                    let mut tag = [0u8; 9];
                    if !matches!(recv.read_exact(&mut tag).await, Ok(true)) {
                        return;
                    }
                    let Ok(mut s) = conn.open_uni().await else {
                        return;
                    };
                    if tag[0] == UPLOAD {
                        let mut n = 0u64;
                        while let Ok(Some(chunk)) = recv.read_chunk(1 << 20).await {
                            n += chunk.len() as u64;
                        }
                        let _ = s.write_all(&n.to_be_bytes()).await;
                    } else {
                        let want = u64::from_be_bytes(tag[1..].try_into().expect("8 bytes"));
                        let chunk = Bytes::from(vec![2u8; CHUNK]);
                        let mut sent = 0;
                        while sent < want {
                            if s.write_chunk(chunk.clone()).await.is_err() {
                                return;
                            }
                            sent += CHUNK as u64;
                        }
                    }
                    let _ = s.finish();
                })
                .detach();
            }
            Err(_) => return,
        }
    }
}

/// Our driver in a process of its own (`felix-bench serve-echo`, see
/// [`serve_echo_child`]), as our broker runs in the broker cells and in production:
/// glommio's park issues a private expedited `membarrier()`, which interrupts every CPU
/// running a thread of the process, so an echo server sharing the client's process would
/// interrupt the client on every park (and the RTT that issue 18's latency targets are
/// judged against would count it). Closing its stdin stops it.
struct Ours {
    addr: SocketAddr,
    pid: u32,
    child: Option<std::process::Child>,
    stdin: Option<std::process::ChildStdin>,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    /// Its certificate and key, as files it read at start.
    _certs: tempfile::TempDir,
}

impl Ours {
    fn shut(&mut self) -> anyhow::Result<()> {
        self.stdin = None;
        match self.child.take() {
            Some(mut child) => crate::broker::reap(&mut child, "the echo server process"),
            None => Ok(()),
        }
    }
}

impl Server for Ours {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn cpu_ns(&self) -> u64 {
        crate::drivers::threads_cpu_ns(&self.pid.to_string(), |_| true).unwrap_or(0)
    }
    fn stop(mut self: Box<Self>) {
        if let Err(e) = self.shut() {
            eprintln!("stopping our echo server: {e:#}");
        }
    }
}

impl Drop for Ours {
    fn drop(&mut self) {
        let _ = self.shut();
    }
}

fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?)
}

/// Our driver on the first `cores` CPUs, every core bound to one port.
pub fn start_ours(certs: &Certs, cores: usize) -> anyhow::Result<Box<dyn Server>> {
    start_ours_spinning(certs, cores, None)
}

/// Our driver as [`start_ours`], each idle core busy-polling for `spin` before it sleeps
/// (the broker's `spin_us`).
pub fn start_ours_spinning(
    certs: &Certs,
    cores: usize,
    spin: Option<Duration>,
) -> anyhow::Result<Box<dyn Server>> {
    let cpus = felix_core_runtime::cores::available_cpus();
    anyhow::ensure!(
        cpus.len() >= cores,
        "this machine has fewer than {cores} CPUs"
    );
    start_ours_on(certs, cpus.into_iter().take(cores).collect(), spin)
}

/// Our driver on exactly these CPUs, one core each, in a process of its own.
pub fn start_ours_on(
    certs: &Certs,
    cpus: Vec<usize>,
    spin: Option<Duration>,
) -> anyhow::Result<Box<dyn Server>> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("cert"), &certs.0.cert_der)?;
    std::fs::write(dir.path().join("key"), &certs.0.key_der)?;
    let cpu_list = cpus
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut args: Vec<std::ffi::OsString> = vec![
        "serve-echo".into(),
        "--cpus".into(),
        cpu_list.into(),
        "--certs".into(),
        dir.path().into(),
    ];
    if let Some(spin) = spin {
        args.extend(["--spin-us".into(), spin.as_micros().to_string().into()]);
    }
    let (child, stdin, stdout, listening) = crate::broker::spawn_self::<Listening>(&args)?;
    Ok(Box::new(Ours {
        addr: listening.addr,
        pid: child.id(),
        child: Some(child),
        stdin: Some(stdin),
        _stdout: stdout,
        _certs: dir,
    }))
}

/// The line an echo server process prints once it listens.
#[derive(serde::Serialize, serde::Deserialize)]
struct Listening {
    addr: SocketAddr,
}

/// The echo server process's side (`felix-bench serve-echo`): our driver on `cpus`, one
/// core each, with the certificate and PKCS#8 key (DER) in the files `cert` and `key` of
/// `certs`; prints where it listens as one JSON line, then serves until stdin closes.
pub fn serve_echo_child(
    cpus: Vec<usize>,
    spin: Option<Duration>,
    certs: &std::path::Path,
) -> anyhow::Result<()> {
    use std::io::Write;
    // The parent may run on the load's CPUs: the cores pin themselves, the rest may use any.
    crate::broker::unpin_self();
    let cert = CertificateDer::from(std::fs::read(certs.join("cert"))?);
    let key = std::fs::read(certs.join("key"))?;
    let cores = cpus.len();
    let set = CoreSet::new(cpus)?;
    let addr = free_port()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let mut config = RuntimeConfig::new(set);
    config.spin_before_park = spin;
    let runtime = Runtime::start(config, move |ctx| {
        let (cert, key) = (cert.clone(), key.clone());
        let tx = tx.clone();
        async move {
            let config = quic::server_config(
                vec![cert],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)),
                TransportLimits::default(),
            )
            .expect("server TLS config");
            let ep = Endpoint::bind(
                addr,
                EndpointOptions {
                    server: Some(Arc::new(config)),
                    crowded_server: None,
                    max_connections: 10_000,
                    reuse_port: true,
                    reset_secret: None,
                    on_sent: None,
                    windows: None,
                },
            )
            .expect("bind");
            let _ = tx.send(());
            let accept = {
                let ep = ep.clone();
                felix_core_runtime::task::spawn(async move {
                    while let Some(conn) = ep.accept().await {
                        felix_core_runtime::task::spawn(serve_ours(conn)).detach();
                    }
                })
            };
            ctx.shutdown.wait().await;
            if std::env::var_os("FELIX_BENCH_DEBUG").is_some() {
                eprintln!("{:?}", ep.stats());
            }
            ep.close(0, b"bench over");
            drop(accept);
        }
    })?;
    for _ in 0..cores {
        rx.recv_timeout(Duration::from_secs(10))
            .context("server core did not start")?;
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(&Listening { addr })?)?;
        out.flush()?;
    }
    // Until the parent closes our stdin (or goes away).
    std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink())?;
    runtime.shutdown();
    let _ = runtime.join();
    Ok(())
}

struct Quinn {
    addr: SocketAddr,
    rt: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
}

impl Server for Quinn {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn cpu_ns(&self) -> u64 {
        crate::drivers::threads_cpu_ns("self", |name| name.starts_with(QUINN_THREADS)).unwrap_or(0)
    }
    fn stop(self: Box<Self>) {
        self.endpoint.close(0u32.into(), b"bench over");
        self.rt.shutdown_timeout(Duration::from_secs(1));
    }
}

/// A plain quinn server on a tokio runtime with `threads` workers.
pub fn start_quinn(certs: &Certs, threads: usize) -> anyhow::Result<Box<dyn Server>> {
    start_quinn_on(certs, threads, None)
}

/// As [`start_quinn`], its workers confined to `cpus` when given.
pub fn start_quinn_on(
    certs: &Certs,
    threads: usize,
    cpus: Option<Vec<usize>>,
) -> anyhow::Result<Box<dyn Server>> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .worker_threads(threads)
        .thread_name(QUINN_THREADS)
        .enable_all();
    if let Some(cpus) = cpus {
        builder.on_thread_start(move || {
            let _ = crate::compare::confine(0, &cpus);
        });
    }
    let rt = builder.build()?;
    let config = quic::server_config(
        vec![certs.0.cert_der.clone()],
        certs.0.key(),
        TransportLimits::default(),
    )?;
    let endpoint =
        rt.block_on(async { quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()) })?;
    let addr = endpoint.local_addr()?;
    let ep = endpoint.clone();
    rt.spawn(async move {
        while let Some(incoming) = ep.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                loop {
                    tokio::select! {
                        bi = conn.accept_bi() => {
                            let Ok((mut send, mut recv)) = bi else { return };
                            tokio::spawn(async move {
                                while let Ok(Some(chunk)) = recv.read_chunk(64 * 1024, true).await {
                                    if send.write_chunk(chunk.bytes).await.is_err() { return; }
                                }
                                let _ = send.finish();
                            });
                        }
                        uni = conn.accept_uni() => {
                            let Ok(mut recv) = uni else { return };
                            let conn = conn.clone();
                            tokio::spawn(async move {
                                let mut tag = [0u8; 9];
                                if recv.read_exact(&mut tag).await.is_err() {
                                    return;
                                }
                                let Ok(mut s) = conn.open_uni().await else { return };
                                if tag[0] == UPLOAD {
                                    let mut n = 0u64;
                                    while let Ok(Some(chunk)) = recv.read_chunk(1 << 20, true).await {
                                        n += chunk.bytes.len() as u64;
                                    }
                                    let _ = s.write_all(&n.to_be_bytes()).await;
                                } else {
                                    let want = u64::from_be_bytes(tag[1..].try_into().expect("8 bytes"));
                                    let chunk = Bytes::from(vec![2u8; CHUNK]);
                                    let mut sent = 0;
                                    while sent < want {
                                        if s.write_chunk(chunk.clone()).await.is_err() {
                                            return;
                                        }
                                        sent += CHUNK as u64;
                                    }
                                }
                                let _ = s.finish();
                            });
                        }
                    }
                }
            });
        }
    });
    Ok(Box::new(Quinn { addr, rt, endpoint }))
}

/// What one transfer cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct Transfer {
    /// Megabytes (10^6) per second of stream payload.
    pub mb_per_sec: f64,
    /// CPU seconds the server's threads spent per GB (10^9) moved.
    pub server_cpu_per_gb: f64,
    /// CPU seconds the client's threads spent per second of wall time (1.0 = one core).
    pub client_cores: f64,
    /// Same for the server's threads.
    pub server_cores: f64,
    /// Seconds it took.
    pub wall: f64,
}

/// Runs `f` (which moves `bytes` of payload) and charges the CPU time `server`'s threads
/// and the client's threads spent meanwhile.
fn measured(
    server: &dyn Server,
    bytes: u64,
    f: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Transfer> {
    let client_ns =
        || crate::drivers::threads_cpu_ns("self", |name| name.starts_with(CLIENT_THREADS));
    let (server_before, client_before) = (server.cpu_ns(), client_ns().unwrap_or(0));
    let started = Instant::now();
    f()?;
    let wall = started.elapsed().as_secs_f64();
    let server_s = server.cpu_ns().saturating_sub(server_before) as f64 / 1e9;
    let client_s = client_ns().unwrap_or(0).saturating_sub(client_before) as f64 / 1e9;
    Ok(Transfer {
        mb_per_sec: bytes as f64 / wall / 1e6,
        server_cpu_per_gb: server_s / (bytes as f64 / 1e9),
        client_cores: client_s / wall,
        server_cores: server_s / wall,
        wall,
    })
}

/// What a run of concurrent echoes cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct Echoes {
    /// Echoes completed per second.
    pub per_sec: f64,
    /// CPU microseconds the server's threads spent per echo.
    pub server_cpu_us: f64,
    /// CPU seconds the server's threads spent per second of wall time.
    pub server_cores: f64,
    /// Same for the client's threads.
    pub client_cores: f64,
}

/// Which way the bulk bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Direction {
    /// Client writes, server counts.
    Upload,
    /// Server writes, client counts.
    Download,
}

/// The client side of every measurement: quinn on tokio, its threads named
/// `bench-client` (the calling thread only waits).
#[derive(Debug)]
pub struct Client {
    rt: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
}

impl Client {
    /// A quinn/tokio client with `threads` workers trusting `certs`.
    pub fn new(certs: &Certs, threads: usize) -> anyhow::Result<Client> {
        Self::new_on(certs, threads, None)
    }

    /// As [`Client::new`], its workers confined to `cpus` when given.
    pub fn new_on(
        certs: &Certs,
        threads: usize,
        cpus: Option<Vec<usize>>,
    ) -> anyhow::Result<Client> {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder
            .worker_threads(threads)
            .thread_name(CLIENT_THREADS)
            .enable_all();
        if let Some(cpus) = cpus {
            builder.on_thread_start(move || {
                let _ = crate::compare::confine(0, &cpus);
            });
        }
        let rt = builder.build()?;
        let mut endpoint =
            rt.block_on(async { quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()) })?;
        endpoint.set_default_client_config(quic::client_config(
            &[certs.ca()],
            false,
            TransportLimits::default(),
        )?);
        Ok(Client { rt, endpoint })
    }

    /// RTT samples (µs) of 64 B echoes on one stream.
    pub fn rtt(&self, addr: SocketAddr, samples: usize) -> anyhow::Result<Vec<f64>> {
        let ep = self.endpoint.clone();
        // Spawned, so the loop runs on the client's worker like every other measurement.
        let task = self.rt.spawn(async move {
            let conn = ep.connect(addr, "localhost")?.await?;
            let (mut s, mut r) = conn.open_bi().await?;
            let msg = [7u8; 64];
            let mut back = [0u8; 64];
            let mut out = Vec::with_capacity(samples);
            for i in 0..samples + samples / 10 {
                let t = Instant::now();
                s.write_all(&msg).await?;
                r.read_exact(&mut back).await?;
                if i >= samples / 10 {
                    out.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            s.finish()?;
            conn.close(0u32.into(), b"");
            anyhow::Ok(out)
        });
        self.rt.block_on(task)?
    }

    /// `n` connections to `addr`, handshakes done (outside any measurement).
    fn connect(&self, addr: SocketAddr, n: usize) -> anyhow::Result<Vec<quinn::Connection>> {
        self.rt.block_on(async {
            let mut conns = Vec::new();
            for _ in 0..n {
                conns.push(self.endpoint.connect(addr, "localhost")?.await?);
            }
            anyhow::Ok(conns)
        })
    }

    /// 64 B echoes kept in flight on `streams` bidirectional streams spread over
    /// `connections` connections, `per_stream` each: the small-request load a broker
    /// sees, where the executor rarely parks, to `server`, charged with its CPU.
    pub fn echoes(
        &self,
        server: &dyn Server,
        connections: usize,
        streams: usize,
        per_stream: usize,
    ) -> anyhow::Result<Echoes> {
        let conns = self.connect(server.addr(), connections)?;
        let total = streams * per_stream;
        let t = measured(server, 0, || {
            self.rt.block_on(async {
                let mut tasks = Vec::new();
                for i in 0..streams {
                    let conn = conns[i % conns.len()].clone();
                    tasks.push(tokio::spawn(async move {
                        let (mut s, mut r) = conn.open_bi().await?;
                        let msg = [7u8; 64];
                        let mut back = [0u8; 64];
                        for _ in 0..per_stream {
                            s.write_all(&msg).await?;
                            r.read_exact(&mut back).await?;
                        }
                        s.finish()?;
                        anyhow::Ok(())
                    }));
                }
                for t in tasks {
                    t.await??;
                }
                anyhow::Ok(())
            })
        })?;
        for c in conns {
            c.close(0u32.into(), b"");
        }
        Ok(Echoes {
            per_sec: total as f64 / t.wall,
            server_cpu_us: t.server_cores * t.wall / total as f64 * 1e6,
            server_cores: t.server_cores,
            client_cores: t.client_cores,
        })
    }

    /// MB/s of `bytes` uploaded to `server` over `connections` connections at once,
    /// 64 KiB writes.
    pub fn throughput(
        &self,
        server: &dyn Server,
        connections: usize,
        bytes: u64,
    ) -> anyhow::Result<f64> {
        Ok(self
            .transfer(server, Direction::Upload, connections, bytes)?
            .mb_per_sec)
    }

    /// Moves `bytes` (split over `connections` connections at once) to or from `server`
    /// in `direction`, charged with its CPU.
    pub fn transfer(
        &self,
        server: &dyn Server,
        direction: Direction,
        connections: usize,
        bytes: u64,
    ) -> anyhow::Result<Transfer> {
        let per = (bytes / connections as u64).div_ceil(CHUNK as u64) * CHUNK as u64;
        let conns = self.connect(server.addr(), connections)?;
        measured(server, per * connections as u64, || {
            self.rt.block_on(async move {
                let mut tasks = Vec::new();
                for conn in conns {
                    tasks.push(tokio::spawn(async move {
                        let mut s = conn.open_uni().await?;
                        let moved = if direction == Direction::Upload {
                            s.write_all(&[UPLOAD; 9]).await?;
                            let chunk = Bytes::from(vec![1u8; CHUNK]);
                            let mut sent = 0u64;
                            while sent < per {
                                s.write_chunk(chunk.clone()).await?;
                                sent += CHUNK as u64;
                            }
                            s.finish()?;
                            let mut back = conn.accept_uni().await?;
                            let count = back.read_to_end(8).await?;
                            u64::from_be_bytes(
                                count.try_into().map_err(|_| anyhow::anyhow!("bad count"))?,
                            )
                        } else {
                            let mut ask = [DOWNLOAD; 9];
                            ask[1..].copy_from_slice(&per.to_be_bytes());
                            s.write_all(&ask).await?;
                            s.finish()?;
                            let mut r = conn.accept_uni().await?;
                            let mut got = 0u64;
                            while let Some(c) = r.read_chunk(1 << 20, false).await? {
                                got += c.bytes.len() as u64;
                            }
                            got
                        };
                        anyhow::ensure!(moved == per, "{direction:?} moved {moved} of {per} bytes");
                        conn.close(0u32.into(), b"");
                        Ok::<(), anyhow::Error>(())
                    }));
                }
                for t in tasks {
                    t.await??;
                }
                anyhow::Ok(())
            })
        })
    }
}

fn medians(v: &[Transfer]) -> Transfer {
    let m = |f: fn(&Transfer) -> f64| median(v.iter().map(f).collect());
    Transfer {
        mb_per_sec: m(|t| t.mb_per_sec),
        server_cpu_per_gb: m(|t| t.server_cpu_per_gb),
        client_cores: m(|t| t.client_cores),
        server_cores: m(|t| t.server_cores),
        wall: m(|t| t.wall),
    }
}

/// Runs the whole comparison and prints Markdown tables.
pub fn run(
    rounds: usize,
    rtt_samples: usize,
    bytes: u64,
    directions: &[Direction],
) -> anyhow::Result<()> {
    let certs = Certs::new()?;
    let client = Client::new(&certs, 1)?;
    let names = [
        "felix driver (glommio + quinn-proto, 1 core)",
        "quinn/tokio (1 worker)",
    ];
    let mut rtts: [Vec<f64>; 3] = Default::default();
    let mut echo_cpu: [Vec<f64>; 3] = Default::default();
    let mut loaded: [Vec<Echoes>; 2] = Default::default();
    let mut up: [Vec<Transfer>; 2] = Default::default();
    let mut down: [Vec<Transfer>; 2] = Default::default();
    let mut scale: [Vec<Transfer>; 2] = Default::default();
    let cpus = felix_core_runtime::cores::available_cpus().len();
    for round in 0..rounds {
        // Alternate the order so neither server always runs first.
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let server = if which == 0 {
                start_ours(&certs, 1)?
            } else {
                start_quinn(&certs, 1)?
            };
            let t = measured(&*server, 0, || {
                rtts[which].extend(client.rtt(server.addr(), rtt_samples)?);
                Ok(())
            })?;
            echo_cpu[which].push(t.server_cores * t.wall / rtt_samples as f64 * 1e6);
            loaded[which].push(client.echoes(
                &*server,
                LOADED_CONNECTIONS,
                LOADED_STREAMS,
                rtt_samples / 10,
            )?);
            for &dir in directions {
                let t = client.transfer(&*server, dir, 1, bytes)?;
                match dir {
                    Direction::Upload => up[which].push(t),
                    Direction::Download => down[which].push(t),
                }
            }
            server.stop();
            eprint!(".");
        }
        let spinning = start_ours_spinning(&certs, 1, Some(SPIN))?;
        let t = measured(&*spinning, 0, || {
            rtts[2].extend(client.rtt(spinning.addr(), rtt_samples)?);
            Ok(())
        })?;
        echo_cpu[2].push(t.server_cores * t.wall / rtt_samples as f64 * 1e6);
        spinning.stop();
        if cpus >= 2 && directions.contains(&Direction::Download) {
            let client2 = Client::new(&certs, 2)?;
            for (i, cores) in [1usize, 2].into_iter().enumerate() {
                let server = start_ours(&certs, cores)?;
                scale[i].push(client2.transfer(&*server, Direction::Download, 2, bytes)?);
                server.stop();
                eprint!(".");
            }
        }
    }
    eprintln!();
    println!("RTT, 64 B echo, one connection ({rounds} x {rtt_samples} samples):\n");
    println!("| server | p50 us | p99 us | p999 us | server CPU us per echo |");
    println!("|---|---|---|---|---|");
    let spin_name = format!("{} + spin {} us", names[0], SPIN.as_micros());
    for (i, name) in names.iter().chain([&spin_name.as_str()]).enumerate() {
        let mut r = rtts[i].clone();
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.1} |",
            percentile(&mut r, 0.5),
            percentile(&mut r, 0.99),
            percentile(&mut r, 0.999),
            median(echo_cpu[i].clone()),
        );
    }
    println!(
        "\n64 B echoes, {LOADED_STREAMS} streams in flight over {LOADED_CONNECTIONS} \
         connections, {} per stream, medians of {rounds}:\n",
        rtt_samples / 10
    );
    println!("| server | echoes/s | server CPU us per echo | server cores | client cores |");
    println!("|---|---|---|---|---|");
    for (i, name) in names.iter().enumerate() {
        let m = |f: fn(&Echoes) -> f64| median(loaded[i].iter().map(f).collect());
        println!(
            "| {name} | {:.0} | {:.1} | {:.2} | {:.2} |",
            m(|e| e.per_sec),
            m(|e| e.server_cpu_us),
            m(|e| e.server_cores),
            m(|e| e.client_cores)
        );
    }
    println!(
        "\nOne connection, 64 KiB writes, {} MB per run, medians of {rounds}; CPU is \
         seconds per GB moved and cores busy (1.0 = one CPU) during the run:\n",
        bytes / 1_000_000
    );
    println!("| server | direction | MB/s | server CPU s/GB | server cores | client cores |");
    println!("|---|---|---|---|---|---|");
    let (u, d) = (
        [medians(&up[0]), medians(&up[1])],
        [medians(&down[0]), medians(&down[1])],
    );
    for (dir, t, ran) in [("upload", &u, &up), ("download", &d, &down)] {
        for (i, name) in names.iter().enumerate().filter(|_| !ran[0].is_empty()) {
            println!(
                "| {name} | {dir} | {:.0} | {:.3} | {:.2} | {:.2} |",
                t[i].mb_per_sec, t[i].server_cpu_per_gb, t[i].server_cores, t[i].client_cores
            );
        }
    }
    let [mut ro, mut rq, mut rs] = rtts.clone();
    println!();
    for (dir, t, ran) in [("upload", &u, &up), ("download", &d, &down)] {
        if !ran[0].is_empty() {
            println!(
                "{dir}: throughput ours/quinn {:.2}x; server CPU per byte quinn/ours {:.2}x",
                t[0].mb_per_sec / t[1].mb_per_sec,
                t[1].server_cpu_per_gb / t[0].server_cpu_per_gb,
            );
        }
    }
    let q99 = percentile(&mut rq, 0.99);
    println!(
        "p99 RTT ours/quinn: {:.2}x; spinning {:.2}x",
        percentile(&mut ro, 0.99) / q99,
        percentile(&mut rs, 0.99) / q99
    );
    if !scale[0].is_empty() {
        let (one, two) = (medians(&scale[0]), medians(&scale[1]));
        println!(
            "scaling, 2 connections, download: 1 core {:.0} MB/s ({:.2} server cores, {:.2} \
             client cores), 2 cores {:.0} MB/s ({:.2} server cores, {:.2} client cores), \
             ratio {:.2}x ({cpus} CPUs on this machine, shared with the client)",
            one.mb_per_sec,
            one.server_cores,
            one.client_cores,
            two.mb_per_sec,
            two.server_cores,
            two.client_cores,
            two.mb_per_sec / one.mb_per_sec
        );
    }
    Ok(())
}
