//! `felix-bench replication`: what replication costs, on one machine. A control plane
//! and three brokers run in this process (each broker on one core, fsync on-commit);
//! one stream with one copy and one Quorum stream with three take the same load, in the
//! same run, alternating: the S7 shape (1 KiB records, batches of 64, one producer, 64
//! batches in flight) for throughput, and the S1 shape (one 1 KiB record at a time) for
//! ack latency. Reports medians of `rounds` and the Quorum / one-copy ratios.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use felix_broker::config::{BrokerConfig, FileConfig, Overrides};
use felix_controlplane::client::ControlPlaneClient;
use felix_controlplane::store::MemoryStore;
use serde_json::json;

use crate::client::{Publisher, Target};
use crate::stats::percentile;

const BOOTSTRAP: &str = "bench-bootstrap";

/// A cluster in this process.
struct Cluster {
    brokers: Vec<felix_broker::server::Broker>,
    admin: ControlPlaneClient,
    ca_pem: String,
    token: String,
    _dir: tempfile::TempDir,
}

fn free_udp() -> anyhow::Result<SocketAddr> {
    Ok(std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?)
}

fn start_controlplane() -> anyhow::Result<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        rt.block_on(async move {
            let config = felix_controlplane::server::ServerConfig {
                listen: "127.0.0.1:0".parse().expect("valid"),
                api: felix_controlplane::api::ApiConfig {
                    bootstrap_token: Some(BOOTSTRAP.into()),
                    heartbeat_interval: Duration::from_millis(200),
                    expiry_timeout: Duration::from_millis(1500),
                    ..Default::default()
                },
                placement_interval: Duration::from_millis(200),
                ..Default::default()
            };
            match felix_controlplane::server::start_with_store(config, Arc::new(MemoryStore::new()))
                .await
            {
                Ok(running) => {
                    let _ = tx.send(Ok(running.addr));
                    std::future::pending::<()>().await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        });
    });
    let addr = rx.recv_timeout(Duration::from_secs(10))??;
    Ok(format!("http://{addr}"))
}

impl Cluster {
    /// `broker_cores[i]`: broker `i`'s cores (a CPU list); cores 0, 1, 0 when empty.
    fn start(broker_cores: &[String]) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new()
            .prefix("felix-bench-repl")
            .tempdir_in("/var/tmp")?;
        let url = start_controlplane()?;
        let anon = ControlPlaneClient::new(&url, None)?;
        let boot = anon.post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )?;
        let admin = anon.with_token(boot["token"].as_str().context("admin token")?);
        admin.post("/v1/tenants", &json!({"tenant_id": "bench"}))?;
        admin.post(
            "/v1/tenants/bench/namespaces",
            &json!({"namespace": "default"}),
        )?;
        let token = admin.post(
            "/v1/tenants/bench/tokens",
            &json!({"sub": "bench", "audience": "felix-broker", "perms": felix_wire::token::all_data_perms("bench")}),
        )?["token"]
            .as_str()
            .context("client token")?
            .to_owned();
        let certs = felix_core_runtime::quic::generate_certs(&["localhost", "127.0.0.1"])?;
        let cert = dir.path().join("cert.pem");
        let ca = dir.path().join("ca.pem");
        std::fs::write(&cert, format!("{}{}", certs.cert_pem, certs.ca_pem))?;
        std::fs::write(&ca, &certs.ca_pem)?;
        let mut brokers = Vec::new();
        for i in 0..3 {
            let node = format!("node-{i}");
            let node_token = admin.post(
                "/v1/tenants/operator/tokens",
                &json!({"sub": node, "audience": "felix-controlplane", "perms": [format!("node.manage:node:{node}"), "node.view:cluster:*"]}),
            )?["token"]
                .as_str()
                .context("node token")?
                .to_owned();
            let listen = free_udp()?;
            let file = FileConfig {
                node_id: Some(node.clone()),
                controlplane_url: Some(url.clone()),
                node_token: Some(node_token),
                peer_ca: Some(ca.clone()),
                internal_listen: Some(free_udp()?.to_string()),
                ..FileConfig::default()
            };
            let config = BrokerConfig::resolve(
                file,
                Overrides {
                    listen: Some(listen.to_string()),
                    http: Some("off".into()),
                    data_dir: Some(dir.path().join(&node)),
                    cores: Some(
                        broker_cores
                            .get(i)
                            .cloned()
                            .unwrap_or_else(|| (i % 2).to_string()),
                    ),
                    fsync: Some("on-commit".into()),
                    ..Overrides::default()
                },
                true,
            )?;
            brokers.push(felix_broker::server::start(
                &config,
                &format!("{}{}", certs.cert_pem, certs.ca_pem),
                &certs.key_pem,
                Default::default(),
            )?);
        }
        Ok(Cluster {
            brokers,
            admin,
            ca_pem: certs.ca_pem,
            token,
            _dir: dir,
        })
    }

    fn create(&self, stream: &str, rf: u32, consistency: &str) -> anyhow::Result<()> {
        self.admin.post(
            "/v1/tenants/bench/namespaces/default/streams",
            &json!({"stream": stream, "kind": "Stream", "shards": 1, "replication_factor": rf, "consistency": consistency}),
        )?;
        Ok(())
    }

    /// The client address of `stream`'s leader, once assigned.
    fn leader(&self, stream: &str) -> Option<SocketAddr> {
        let items = self.admin.get("/v1/shard-assignments").ok()?;
        let leader = items["items"]
            .as_array()?
            .iter()
            .find(|a| a["name"] == stream)?["leader"]
            .as_str()?
            .to_owned();
        let i: usize = leader.strip_prefix("node-")?.parse().ok()?;
        Some(self.brokers.get(i)?.started.listen)
    }

    fn target(&self, addr: SocketAddr) -> Target {
        Target {
            addr,
            ca_pem: self.ca_pem.clone(),
            tenant: "bench".into(),
            token: self.token.clone(),
        }
    }
}

/// Publishes `batches` batches of `batch` 1 KiB records with `window` in flight;
/// returns (records acknowledged per second, ack latencies in µs).
async fn load(
    target: &Target,
    stream: &str,
    batch: usize,
    batches: usize,
    window: usize,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let (_ep, conn) = target.connect().await?;
    let mut p = Publisher::open(target, &conn, window).await?;
    let payloads: Vec<Bytes> = (0..batch).map(|_| Bytes::from(vec![7u8; 1024])).collect();
    let started = Instant::now();
    for _ in 0..batches {
        // Stamped once the window lets it go (not while it waits for the last ack).
        p.publish(target, "default", stream, &payloads).await?;
    }
    let lat = p.finish().await?;
    let secs = started.elapsed().as_secs_f64();
    Ok(((batch * batches) as f64 / secs, lat))
}

/// Waits until `stream` takes writes at its leader.
async fn ready(c: &Cluster, stream: &str) -> anyhow::Result<Target> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(addr) = c.leader(stream) {
            let t = c.target(addr);
            let probe =
                tokio::time::timeout(Duration::from_secs(2), load(&t, stream, 1, 1, 1)).await;
            if matches!(probe, Ok(Ok(_))) {
                return Ok(t);
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "{stream} never took writes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the comparison; returns the report.
/// `broker_cores`: each broker's CPU list (cores 0, 1, 0 when empty, as on a two-core
/// machine); `load_cores`: the CPUs the load generator's threads are confined to.
pub fn run(
    rounds: usize,
    batches: usize,
    samples: usize,
    broker_cores: &[String],
    load_cores: Option<&str>,
) -> anyhow::Result<String> {
    anyhow::ensure!(
        broker_cores.is_empty() || broker_cores.len() == 3,
        "--broker-cores names the three brokers' cores (e.g. 0,1,2)"
    );
    let c = Cluster::start(broker_cores)?;
    c.create("one", 1, "Leader")?;
    c.create("quorum3", 3, "Quorum")?;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if let Some(list) = load_cores {
        let cpus = crate::compare::parse_cpus(list)?;
        builder.worker_threads(cpus.len().max(1));
        builder.on_thread_start(move || {
            let _ = crate::compare::confine(0, &cpus);
        });
    }
    let rt = builder.build()?;
    let (one, q3) = rt.block_on(async {
        Ok::<_, anyhow::Error>((ready(&c, "one").await?, ready(&c, "quorum3").await?))
    })?;
    let mut tput = (Vec::new(), Vec::new());
    let mut p50 = (Vec::new(), Vec::new());
    let mut p99 = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for (name, target, t, l50, l99) in [
            ("one", &one, &mut tput.0, &mut p50.0, &mut p99.0),
            ("quorum3", &q3, &mut tput.1, &mut p50.1, &mut p99.1),
        ] {
            let (rate, _) = rt.block_on(load(target, name, 64, batches, 64))?;
            let (_, mut lat) = rt.block_on(load(target, name, 1, samples, 1))?;
            let (q50, q99) = (percentile(&mut lat, 0.50), percentile(&mut lat, 0.99));
            t.push(rate);
            l50.push(q50);
            l99.push(q99);
            eprintln!(
                "round {round} {name}: {rate:.0} msgs/s (S7 shape), one at a time p50 {q50:.0} µs p99 {q99:.0} µs"
            );
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (t1, t3) = (med(&mut tput.0), med(&mut tput.1));
    let (a1, a3) = (med(&mut p50.0), med(&mut p50.1));
    let (b1, b3) = (med(&mut p99.0), med(&mut p99.1));
    for b in c.brokers {
        let _ = b.shutdown();
    }
    let placed = if broker_cores.is_empty() {
        "0, 1, 0".to_owned()
    } else {
        broker_cores.join(", ")
    };
    Ok(format!(
        "| cell | one copy | Quorum, 3 copies | ratio |\n|---|---|---|---|\n\
         | durable throughput, S7 shape (msgs/s) | {t1:.0} | {t3:.0} | {:.2}x |\n\
         | one at a time, ack p50 (µs) | {a1:.0} | {a3:.0} | {:.2}x |\n\
         | one at a time, ack p99 (µs) | {b1:.0} | {b3:.0} | {:.2}x |\n\
         (medians of {rounds} rounds; 3 brokers and a control plane in one process on this machine, fsync on-commit; \
         broker cores {placed})",
        t3 / t1,
        a3 / a1,
        b3 / b1
    ))
}
