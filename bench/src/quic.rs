//! QUIC transport benchmark: our glommio + quinn-proto driver against a plain quinn/tokio
//! server built the same way (same TLS, same transport limits, same echo service), with
//! the same quinn/tokio client driving both, in one run.
//!
//! - RTT: one connection, one bidirectional stream, 64 B written and read back, repeated.
//! - Throughput: one connection, one unidirectional stream, 64 KiB writes; the server
//!   counts the bytes and answers the count when the stream ends.
//! - Scaling: our driver on 1 core and on 2 cores (SO_REUSEPORT), 2 connections.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use felix_core_runtime::CoreSet;
use felix_core_runtime::quic::{self, Connection, Endpoint, EndpointOptions, TransportLimits};
use felix_core_runtime::runtime::{Runtime, RuntimeConfig};
use rustls::pki_types::CertificateDer;

use crate::stats::{median, percentile};

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
                glommio::spawn_local(async move {
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
                glommio::spawn_local(async move {
                    let mut n = 0u64;
                    while let Ok(Some(chunk)) = recv.read_chunk(1 << 20).await {
                        n += chunk.len() as u64;
                    }
                    if let Ok(mut s) = conn.open_uni().await {
                        let _ = s.write_all(&n.to_be_bytes()).await;
                        let _ = s.finish();
                    }
                })
                .detach();
            }
            Err(_) => return,
        }
    }
}

struct Ours {
    addr: SocketAddr,
    runtime: Runtime,
}

impl Server for Ours {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn stop(self: Box<Self>) {
        self.runtime.shutdown();
        let _ = self.runtime.join();
    }
}

fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(UdpSocket::bind("127.0.0.1:0")?.local_addr()?)
}

/// Our driver on the first `cores` CPUs, every core bound to one port.
pub fn start_ours(certs: &Certs, cores: usize) -> anyhow::Result<Box<dyn Server>> {
    let cpus = felix_core_runtime::cores::available_cpus();
    let set = CoreSet::new(cpus.into_iter().take(cores).collect())?;
    anyhow::ensure!(
        set.len() == cores,
        "this machine has fewer than {cores} CPUs"
    );
    let addr = free_port()?;
    let certs = certs.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let runtime = Runtime::start(RuntimeConfig::new(set), move |ctx| {
        let certs = certs.clone();
        let tx = tx.clone();
        async move {
            let config = quic::server_config(
                vec![certs.0.cert_der.clone()],
                certs.0.key(),
                TransportLimits::default(),
            )
            .expect("server TLS config");
            let ep = Endpoint::bind(
                addr,
                EndpointOptions {
                    server: Some(Arc::new(config)),
                    max_connections: 10_000,
                    reuse_port: true,
                },
            )
            .expect("bind");
            let _ = tx.send(());
            let accept = {
                let ep = ep.clone();
                glommio::spawn_local(async move {
                    while let Some(conn) = ep.accept().await {
                        glommio::spawn_local(serve_ours(conn)).detach();
                    }
                })
            };
            ctx.shutdown.wait().await;
            ep.close(0, b"bench over");
            drop(accept);
        }
    })?;
    for _ in 0..cores {
        rx.recv_timeout(Duration::from_secs(10))
            .context("server core did not start")?;
    }
    Ok(Box::new(Ours { addr, runtime }))
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
    fn stop(self: Box<Self>) {
        self.endpoint.close(0u32.into(), b"bench over");
        self.rt.shutdown_timeout(Duration::from_secs(1));
    }
}

/// A plain quinn server on a tokio runtime with `threads` workers.
pub fn start_quinn(certs: &Certs, threads: usize) -> anyhow::Result<Box<dyn Server>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
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
                                let mut n = 0u64;
                                while let Ok(Some(chunk)) = recv.read_chunk(1 << 20, true).await {
                                    n += chunk.bytes.len() as u64;
                                }
                                if let Ok(mut s) = conn.open_uni().await {
                                    let _ = s.write_all(&n.to_be_bytes()).await;
                                    let _ = s.finish();
                                }
                            });
                        }
                    }
                }
            });
        }
    });
    Ok(Box::new(Quinn { addr, rt, endpoint }))
}

/// The client side of every measurement.
#[derive(Debug)]
pub struct Client {
    rt: tokio::runtime::Runtime,
    endpoint: quinn::Endpoint,
}

impl Client {
    /// A quinn/tokio client with `threads` workers trusting `certs`.
    pub fn new(certs: &Certs, threads: usize) -> anyhow::Result<Client> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?;
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
        self.rt.block_on(async move {
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
            Ok(out)
        })
    }

    /// MB/s of `bytes` sent over `connections` connections at once, 64 KiB writes.
    pub fn throughput(
        &self,
        addr: SocketAddr,
        connections: usize,
        bytes: u64,
    ) -> anyhow::Result<f64> {
        let ep = self.endpoint.clone();
        self.rt.block_on(async move {
            let mut conns = Vec::new();
            for _ in 0..connections {
                conns.push(ep.connect(addr, "localhost")?.await?);
            }
            let started = Instant::now();
            let mut tasks = Vec::new();
            for conn in conns {
                let per = bytes / connections as u64;
                tasks.push(tokio::spawn(async move {
                    let chunk = bytes::Bytes::from(vec![1u8; 64 * 1024]);
                    let mut s = conn.open_uni().await?;
                    let mut sent = 0u64;
                    while sent < per {
                        s.write_chunk(chunk.clone()).await?;
                        sent += chunk.len() as u64;
                    }
                    s.finish()?;
                    let mut back = conn.accept_uni().await?;
                    let count = back.read_to_end(8).await?;
                    let n = u64::from_be_bytes(
                        count.try_into().map_err(|_| anyhow::anyhow!("bad count"))?,
                    );
                    anyhow::ensure!(n == sent, "server counted {n} of {sent} bytes");
                    conn.close(0u32.into(), b"");
                    Ok::<u64, anyhow::Error>(sent)
                }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await??;
            }
            Ok(total as f64 / started.elapsed().as_secs_f64() / 1e6)
        })
    }
}

/// Runs the whole comparison and prints a Markdown table.
pub fn run(rounds: usize, rtt_samples: usize, bytes: u64) -> anyhow::Result<()> {
    let certs = Certs::new()?;
    let client = Client::new(&certs, 1)?;
    let mut rtts: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut tputs: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut scale: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        // Alternate the order so neither server always runs first.
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let server = if which == 0 {
                start_ours(&certs, 1)?
            } else {
                start_quinn(&certs, 1)?
            };
            rtts[which].extend(client.rtt(server.addr(), rtt_samples)?);
            tputs[which].push(client.throughput(server.addr(), 1, bytes)?);
            server.stop();
            eprint!(".");
        }
        let cpus = felix_core_runtime::cores::available_cpus().len();
        if cpus >= 2 {
            let client2 = Client::new(&certs, 2)?;
            for (i, cores) in [1usize, 2].into_iter().enumerate() {
                let server = start_ours(&certs, cores)?;
                scale[i].push(client2.throughput(server.addr(), 2, bytes)?);
                server.stop();
                eprint!(".");
            }
        }
    }
    eprintln!();
    println!("| server | RTT p50 us | p99 us | p999 us | 1-conn MB/s (median of {rounds}) |");
    println!("|---|---|---|---|---|");
    for (i, name) in [
        "felix driver (glommio + quinn-proto, 1 core)",
        "quinn/tokio (1 worker)",
    ]
    .iter()
    .enumerate()
    {
        let mut r = rtts[i].clone();
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.0} |",
            percentile(&mut r, 0.5),
            percentile(&mut r, 0.99),
            percentile(&mut r, 0.999),
            median(tputs[i].clone())
        );
    }
    let (ours, theirs) = (median(tputs[0].clone()), median(tputs[1].clone()));
    let (mut ro, mut rq) = (rtts[0].clone(), rtts[1].clone());
    println!(
        "\nthroughput ratio ours/quinn: {:.2}x; p99 RTT ratio ours/quinn: {:.2}x",
        ours / theirs,
        percentile(&mut ro, 0.99) / percentile(&mut rq, 0.99)
    );
    if !scale[0].is_empty() {
        let (one, two) = (median(scale[0].clone()), median(scale[1].clone()));
        println!(
            "scaling, 2 connections: 1 core {one:.0} MB/s, 2 cores {two:.0} MB/s, ratio {:.2}x \
             (client shares the same CPUs)",
            two / one
        );
    }
    Ok(())
}
