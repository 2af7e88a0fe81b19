//! Starting and stopping a broker: one pinned executor per core, each with its own QUIC
//! socket on the shared port, its shards, and its end of the mesh.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use felix_core_runtime::mesh::MeshBuilder;
use felix_core_runtime::placement::{Placement, PlacementTable};
use felix_core_runtime::quic::{self, Endpoint, EndpointOptions, TransportLimits};
use felix_core_runtime::runtime::{Runtime, RuntimeConfig, ShutdownHandle};
use felix_core_runtime::task;
use felix_storage_uring::{LogConfig, memlock};

use crate::auth::TenantKeys;
use crate::catalog::{Catalog, StreamSpec};
use crate::cluster::Cluster;
use crate::config::BrokerConfig;
use crate::core::{CoreBroker, CoreMetrics, CoreMsg, Shared};
use crate::forward::Forwarder;
use crate::replication::machine::NodeId;
use crate::replication::peer::{self, Outbound, PeerAuth};
use crate::replication::replica::Replicas;
use crate::session;
use felix_storage_uring::StorageFaults;
use felix_wire::internal::InternalMessage;
use std::rc::Rc;

/// Cross-core channel capacity, in messages.
const MESH_CAPACITY: usize = 1024;
/// io_uring buffer memory per core.
const IO_MEMORY_PER_CORE: usize = 8 << 20;

/// The broker-to-broker listener and client settings.
struct Internal {
    listen: SocketAddr,
    server: Arc<quic::ServerConfig>,
    client: quic::ClientConfig,
    server_name: String,
    token: String,
    allow_unauthenticated: bool,
}

/// What a started broker tells its caller.
#[derive(Debug, Clone)]
pub struct Started {
    /// QUIC address.
    pub listen: SocketAddr,
    /// HTTP address, if enabled.
    pub http: Option<SocketAddr>,
}

/// A running broker.
#[derive(Debug)]
pub struct Broker {
    runtime: Runtime,
    /// Addresses.
    pub started: Started,
    /// Shared state (metrics, catalog).
    pub shared: Arc<Shared>,
}

impl Broker {
    /// Stops the broker: stop accepting, end subscriptions, flush logs, join cores.
    pub fn shutdown(self) -> anyhow::Result<()> {
        self.runtime.shutdown();
        self.runtime.join().map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// The stop signal.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.runtime.shutdown_handle()
    }

    /// Waits for the cores to finish (after the shutdown handle fired).
    pub fn join(self) -> anyhow::Result<()> {
        self.runtime.join().map_err(|e| anyhow::anyhow!("{e}"))
    }
}

fn free_port(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    Ok(std::net::UdpSocket::bind(addr)?.local_addr()?)
}

/// The QUIC stateless-reset secret, kept in `<data_dir>/quic-reset.secret` (created
/// once, mode 0600): a restarted broker resets the connections its previous run held,
/// so clients and peers reconnect at once instead of after their idle timeout.
fn reset_secret(data_dir: &std::path::Path) -> anyhow::Result<[u8; 32]> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("quic-reset.secret");
    match std::fs::read(&path) {
        Ok(bytes) => {
            return bytes.try_into().map_err(|b: Vec<u8>| {
                anyhow::anyhow!("{}: {} bytes, expected 32", path.display(), b.len())
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(anyhow::anyhow!("{}: {e}", path.display())),
    }
    let mut secret = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
        .map_err(|_| anyhow::anyhow!("no system randomness"))?;
    let tmp = data_dir.join("quic-reset.secret.tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| anyhow::anyhow!("{}: {e}", tmp.display()))?;
    f.write_all(&secret)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(data_dir)?.sync_all()?;
    Ok(secret)
}

/// This broker process's identity towards the control plane: derived from the reset
/// secret, so it is the same across restarts over one data directory and different for
/// a broker started elsewhere under the same node id (which the control plane refuses
/// while this one heartbeats). The secret itself never leaves the machine.
fn instance_id(secret: &[u8; 32]) -> String {
    let mut input = b"felix node instance\0".to_vec();
    input.extend_from_slice(secret);
    let d = ring::digest::digest(&ring::digest::SHA256, &input);
    d.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Starts a broker with TLS material and verification keys already resolved.
pub fn start(
    config: &BrokerConfig,
    cert_pem: &str,
    key_pem: &str,
    keys: TenantKeys,
) -> anyhow::Result<Broker> {
    let cores = config.cores.len();
    match memlock::ensure((IO_MEMORY_PER_CORE * cores) as u64)? {
        memlock::MemlockStatus::Privileged => {
            tracing::info!(
                "RLIMIT_MEMLOCK is low but CAP_IPC_LOCK allows io_uring buffer registration"
            )
        }
        other => tracing::debug!(?other, "locked memory"),
    }
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|e| anyhow::anyhow!("data dir {}: {e}", config.data_dir.display()))?;
    crate::core::empty_left_copies_trash(&config.data_dir);
    let reset_secret = reset_secret(&config.data_dir)?;
    let catalog = Arc::new(Catalog::open(
        Some(config.data_dir.join("catalog.json")),
        config.auto_create_shards,
    )?);
    for s in &config.streams {
        let held = catalog
            .create_stream(&s.tenant, &s.namespace, &s.name, StreamSpec::new(s.shards))
            .map_err(|e| anyhow::anyhow!("streams: {e}"))?;
        // A stream's shard count cannot change: an edited `shards` was ignored in
        // silence, the broker serving the count its data has. Following a control
        // plane, its count is the control plane's: said, not refused.
        if held.shards != s.shards && config.cluster.is_some() {
            tracing::warn!(
                stream = %format!("{}/{}/{}", s.tenant, s.namespace, s.name),
                held = held.shards,
                declared = s.shards,
                "a declared stream's shard count differs from the one it has; it keeps that"
            );
        } else if held.shards != s.shards {
            anyhow::bail!(
                "streams: {}/{}/{} has {} shards here; the configuration says {} (a \
                 stream's shard count cannot change: make a new stream)",
                s.tenant,
                s.namespace,
                s.name,
                held.shards,
                s.shards
            );
        }
    }
    // Tenants' keys as a verifier needs them: 32-byte Ed25519 keys, one per key id (a
    // pasted SPKI or a duplicate id was taken, and every token of the tenant failed).
    for t in &config.tenants {
        let mut kids = std::collections::HashSet::new();
        for k in &t.keys {
            if !kids.insert(k.kid.as_str()) {
                anyhow::bail!("tenants.{}.keys: key id {} is listed twice", t.id, k.kid);
            }
            let pk = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(k.public_key.trim_end_matches('='))
                .map_err(|e| anyhow::anyhow!("tenants.{}.keys.{}: {e}", t.id, k.kid))?;
            if pk.len() != 32 {
                anyhow::bail!(
                    "tenants.{}.keys.{}: an Ed25519 public key is 32 bytes, this one {}",
                    t.id,
                    k.kid,
                    pk.len()
                );
            }
        }
    }
    catalog
        .persist()
        .map_err(|e| anyhow::anyhow!("catalog: {e}"))?;
    let mut keys = keys;
    for t in &config.tenants {
        for k in &t.keys {
            let pk = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(k.public_key.trim_end_matches('='))
                .map_err(|e| anyhow::anyhow!("tenants.{}.keys.{}: {e}", t.id, k.kid))?;
            keys.add(&t.id, &k.kid, pk);
        }
    }
    // Pins set live (`POST /pins`, `felix pin`) come first: each was made to win over
    // what was there when it was set. One naming a core this start does not run is
    // dropped with a warning rather than refusing to start.
    let mut pins = Vec::new();
    for rule in crate::core::moves::read_pins(&crate::core::moves::pins_file(&config.data_dir))
        .map_err(|e| anyhow::anyhow!("live pins: {e}"))?
    {
        if rule.core.index() >= cores {
            tracing::warn!(rule = %rule, cores, "a live pin names a core this broker does not run; ignored");
            continue;
        }
        pins.push(rule);
    }
    pins.extend(config.pins.iter().cloned());
    let placement = Arc::new(Placement::new(PlacementTable::new(cores, pins, 0)?));
    let (repins, repin_jobs) = futures_channel::mpsc::unbounded();
    let keys = Arc::new(arc_swap::ArcSwap::from_pointee(keys));
    let cluster = config.cluster.as_ref().map(|_| {
        let mut c = Cluster::new(config.node_id.clone());
        c.mutants = config.mutants;
        Arc::new(c)
    });
    let peer_config = match &config.cluster {
        None => None,
        Some(c) => {
            // Peers are trusted through `peer_ca`, or else the CA of our own chain (the
            // last certificate in it).
            let roots = match &c.peer_ca {
                Some(p) => quic::certs_from_pem(
                    &std::fs::read_to_string(p)
                        .map_err(|e| anyhow::anyhow!("peer_ca {}: {e}", p.display()))?,
                )?,
                None => quic::certs_from_pem(cert_pem)?
                    .last()
                    .cloned()
                    .into_iter()
                    .collect(),
            };
            Some((
                [
                    quic::forwarding_client_config(
                        &roots,
                        crate::forward::transport_limits(),
                        false,
                    )?,
                    quic::forwarding_client_config(
                        &roots,
                        crate::forward::transport_limits(),
                        true,
                    )?,
                ],
                c.peer_server_name.clone(),
            ))
        }
    };
    // Replication: a broker-to-broker listener and client config, when configured.
    let internal = match &config.cluster {
        Some(c) if c.internal_listen.is_some() => {
            let roots = match &c.peer_ca {
                Some(p) => quic::certs_from_pem(
                    &std::fs::read_to_string(p)
                        .map_err(|e| anyhow::anyhow!("peer_ca {}: {e}", p.display()))?,
                )?,
                None => quic::certs_from_pem(cert_pem)?
                    .last()
                    .cloned()
                    .into_iter()
                    .collect(),
            };
            let limits = TransportLimits::default();
            let server = quic::internal_server_config(
                quic::certs_from_pem(cert_pem)?,
                quic::key_from_pem(key_pem)?,
                limits,
            )?;
            let listen = free_port(c.internal_listen.expect("checked above"))?;
            if c.internal_allow_unauthenticated {
                tracing::warn!(
                    "internal_allow_unauthenticated: peers are trusted without a node token"
                );
            }
            Some(Arc::new(Internal {
                listen,
                server: Arc::new(server),
                client: quic::internal_client_config(&roots, limits)?,
                server_name: c.peer_server_name.clone(),
                token: c.token.clone(),
                allow_unauthenticated: c.internal_allow_unauthenticated,
            }))
        }
        _ => None,
    };
    let chain = quic::certs_from_pem(cert_pem)?;
    let key = quic::key_from_pem(key_pem)?;
    let transport = TransportLimits {
        max_streams: config.max_streams,
        idle_timeout: config.idle_timeout,
        ..TransportLimits::default()
    };
    let server_config = Arc::new(quic::server_config(chain, key, transport)?);
    let crowded_config = Arc::new(quic::crowded_server_config(&server_config, &transport));
    let listen = free_port(config.listen)?;
    let shared = Arc::new(Shared {
        data_dir: config.data_dir.clone(),
        log_config: LogConfig {
            fsync: config.fsync,
            segment_bytes_max: config.segment_bytes,
            write_linger: config.write_linger,
            zero_ahead_bytes: config.zero_ahead_bytes,
            dsync_writes: config.dsync_writes,
            ..LogConfig::default()
        },
        catalog,
        placement,
        keys: keys.clone(),
        cluster: cluster.clone(),
        node_id: config.node_id.clone(),
        client_addr: (!listen.ip().is_unspecified()).then_some(listen),
        publish_window: config.publish_window,
        connection_window_bytes: transport.connection_window_bytes,
        max_streams: transport.max_streams,
        group_limits: config.group_limits,
        cache_compact_after: config.cache_compact_after,
        producer_snapshot_bytes: config.producer_snapshot_bytes,
        subscriber_queue: config.subscriber_queue,
        max_frame_bytes: felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES,
        limits: config.limits,
        housekeeping_interval: config.housekeeping_interval,
        damaged_copies_kept: config.damaged_copies_kept,
        damaged_in_flight: Default::default(),
        metrics: (0..cores).map(|_| Arc::default()).collect(),
        ready: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
        faults: config.fault_injection.then(StorageFaults::new),
        mutants: config.mutants,
        panic_core: std::sync::atomic::AtomicI64::new(-1),
        replica_sync_paused: std::sync::atomic::AtomicBool::new(false),
        opens_held: std::sync::atomic::AtomicBool::new(false),
        repins,
        repin_jobs: Mutex::new(Some(repin_jobs)),
        // With one core there is nowhere to move a shard to.
        follow_load: config.follow_load && config.cores.len() > 1,
        load_reports: Mutex::default(),
        auto_pins: Mutex::default(),
        watch_snapshots: Arc::new(crate::shard::snapshots::SnapshotBudget::new(
            config.limits.watch_snapshot_bytes,
        )),
    });
    // Damaged replica copies beyond the bound (left by an earlier run, or by a lower
    // `damaged_copies_kept`) go before any core opens a shard.
    match crate::core::prune_damaged_copies(
        &shared.data_dir.join(crate::core::DAMAGED_DIR),
        shared.damaged_copies_kept,
        &shared.damaged_in_flight,
    ) {
        Ok(deleted) if !deleted.is_empty() => tracing::warn!(
            ?deleted,
            kept = shared.damaged_copies_kept,
            "deleted the oldest damaged copies (damaged_copies_kept)"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "pruning damaged copies"),
    }
    let http = match config.http {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                tracing::warn!(%addr, "the admin HTTP endpoint listens off loopback: it takes no token, and POST /pins moves shards; keep it on a management network");
            }
            Some(crate::http::spawn(addr, shared.clone())?)
        }
        None => None,
    };
    if config.fault_injection {
        tracing::warn!(
            "fault injection is on (/debug endpoints can fail storage and panic cores): tests and chaos runs only, never in production"
        );
    }
    let mesh = Arc::new(Mutex::new(MeshBuilder::<CoreMsg>::new(
        cores,
        MESH_CAPACITY,
    )));
    let bound = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(Mutex::new(None::<String>));
    let max_connections = config.max_connections;
    // A core's connections' QUIC windows, each endpoint's from a budget of its own (the
    // peers' endpoint's transport limits are the defaults, as the clients' are).
    let windows = quic::WindowBudget {
        bytes: config.quic_window_bytes_per_core,
        max_per_direction: u64::from(transport.connection_window_bytes)
            .min(transport.send_window_bytes),
    };
    let (shared2, bound2, failed2) = (shared.clone(), bound.clone(), failed.clone());
    let peer_config = Arc::new(peer_config);
    let (internal2, keys2, cluster2) = (internal.clone(), keys.clone(), cluster.clone());
    let runtime = Runtime::start(
        RuntimeConfig {
            io_memory_bytes: IO_MEMORY_PER_CORE,
            spin_before_park: config.spin,
            ..RuntimeConfig::new(config.cores.clone())
        },
        move |ctx| {
            let ends = mesh.lock().expect("mesh builder lock").take(ctx.core);
            let (shared, server_config, crowded_config, bound, failed, peer_config) = (
                shared2.clone(),
                server_config.clone(),
                crowded_config.clone(),
                bound2.clone(),
                failed2.clone(),
                peer_config.clone(),
            );
            let (internal, keys, cluster) = (internal2.clone(), keys2.clone(), cluster2.clone());
            async move {
                // glommio reads the data device's properties from sysfs on its first
                // O_DIRECT open on each core, and panics if that read fails (out of file
                // descriptors, say). Do it now, while descriptors are plentiful: a shard
                // opened later under a low limit then gets a typed, retryable refusal.
                if let Err(e) = felix_storage_uring::DmaBackend::open_dir(&shared.data_dir).await {
                    *failed.lock().expect("failure slot") = Some(format!(
                        "opening the data directory {}: {e}",
                        shared.data_dir.display()
                    ));
                    bound.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                let mut mesh = ends.connect().await;
                let inboxes = mesh.take_receivers();
                let forwarder = match peer_config.as_ref() {
                    None => None,
                    Some((cfg, name)) => match Forwarder::bind(cfg.clone(), name.clone()) {
                        Ok(f) => Some(f),
                        Err(e) => {
                            *failed.lock().expect("failure slot") =
                                Some(format!("binding the forwarding endpoint: {e}"));
                            bound.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    },
                };
                let replicas = match (internal.as_deref(), &cluster) {
                    (Some(i), Some(cluster)) => {
                        match Outbound::bind(
                            i.listen.ip(),
                            &shared.node_id,
                            &i.token,
                            i.client.clone(),
                            i.server_name.clone(),
                        ) {
                            Ok(out) => Some(Rc::new(Replicas::new(
                                shared.node_id.as_str().into(),
                                ctx.core,
                                cluster.clone(),
                                out,
                                shared.metrics[ctx.core.index()].clone(),
                            ))),
                            Err(e) => {
                                *failed.lock().expect("failure slot") =
                                    Some(format!("binding the replication client endpoint: {e}"));
                                bound.fetch_add(1, Ordering::SeqCst);
                                return;
                            }
                        }
                    }
                    _ => None,
                };
                let core = CoreBroker::new(ctx.core, shared.clone(), mesh, forwarder, replicas);
                // Unready from the moment this core stops serving, however it stops.
                let _alive = Alive::new(&core.metrics);
                core.serve_mesh(inboxes);
                core.sample_log_stats();
                core.start_housekeeping();
                core.start_replication();
                core.start_repins();
                core.start_load_reports();
                let internal_ep = match internal.as_deref() {
                    None => None,
                    Some(i) => match Endpoint::bind(
                        i.listen,
                        EndpointOptions {
                            server: Some(i.server.clone()),
                            crowded_server: None,
                            max_connections: crate::config::PEER_CONNECTIONS_PER_CORE,
                            reuse_port: true,
                            reset_secret: Some(reset_secret),
                            on_sent: None,
                            windows: Some(windows),
                        },
                    ) {
                        Ok(ep) => {
                            let auth = PeerAuth {
                                keys: keys.clone(),
                                allow_unauthenticated: i.allow_unauthenticated,
                            };
                            let c = core.clone();
                            let deliver: Rc<dyn Fn(NodeId, InternalMessage)> =
                                Rc::new(move |from, msg| c.route_peer(from, msg));
                            task::spawn(peer::serve(ep.clone(), auth, deliver)).detach();
                            Some(ep)
                        }
                        Err(e) => {
                            *failed.lock().expect("failure slot") = Some(format!(
                                "binding the replication listener {}: {e}",
                                i.listen
                            ));
                            bound.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    },
                };
                let ep = match Endpoint::bind(
                    listen,
                    EndpointOptions {
                        server: Some(server_config),
                        crowded_server: Some(crowded_config),
                        max_connections,
                        reuse_port: true,
                        reset_secret: Some(reset_secret),
                        on_sent: Some({
                            let metrics = core.metrics.clone();
                            Arc::new(move |waited| metrics.answer_send.observe(waited))
                        }),
                        windows: Some(windows),
                    },
                ) {
                    Ok(ep) => ep,
                    Err(e) => {
                        *failed.lock().expect("failure slot") =
                            Some(format!("binding {listen}: {e}"));
                        bound.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                };
                bound.fetch_add(1, Ordering::SeqCst);
                let accept = {
                    let (ep, core) = (ep.clone(), core.clone());
                    task::spawn(async move {
                        while let Some(conn) = ep.accept().await {
                            if core.refusing_connections() {
                                session::close_for_shutdown(&conn);
                                continue;
                            }
                            task::spawn(session::serve_connection(core.clone(), conn)).detach();
                        }
                    })
                };
                let key_watch = task::spawn(session::watch_keys(core.clone()));
                ctx.shutdown.wait().await;
                // Stop accepting, end subscriptions, flush every log, then close
                // connections (code 0, "broker shutting down").
                core.shutdown().await;
                ep.close(0, b"broker shutting down");
                if let Some(iep) = &internal_ep {
                    iep.close(0, b"broker shutting down");
                }
                let _ = task::timeout(Duration::from_secs(2), ep.wait_idle()).await;
                drop(accept);
                drop(key_watch);
            }
        },
    )?;
    while bound.load(Ordering::SeqCst) < cores {
        std::thread::sleep(Duration::from_millis(5));
    }
    if let Some(e) = failed.lock().expect("failure slot").take() {
        runtime.shutdown();
        let _ = runtime.join();
        anyhow::bail!(e);
    }
    // Serving first, then joining: the control plane assigns shards to a node only
    // after it registers, and by then it answers on its port.
    if let (Some(settings), Some(cluster)) = (&config.cluster, &cluster)
        && let Err(e) = crate::cluster::join(
            settings,
            cluster.clone(),
            shared.catalog.clone(),
            keys.clone(),
            &instance_id(&reset_secret),
            Duration::from_secs(30),
        )
    {
        runtime.shutdown();
        let _ = runtime.join();
        return Err(e);
    }
    shared.ready.store(true, Ordering::SeqCst);
    Ok(Broker {
        runtime,
        started: Started { listen, http },
        shared,
    })
}

/// Marks a core alive while it serves.
struct Alive(Arc<CoreMetrics>);

impl Alive {
    fn new(m: &Arc<CoreMetrics>) -> Alive {
        m.alive.store(1, Ordering::SeqCst);
        Alive(m.clone())
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.alive.store(0, Ordering::SeqCst);
    }
}

/// How long a broker stopping on a signal waits for its shards to move to replicas.
const DRAIN_PATIENCE: Duration = Duration::from_secs(15);

/// The signals a broker stops on (SIGTERM, SIGINT), registered before it starts: the
/// registration takes file descriptors, which a broker serving at its open-files limit
/// may not have a moment later (a chaos run saw a broker exit 1 for it right after it
/// reported itself up).
pub fn stop_signals() -> anyhow::Result<signal_hook::iterator::Signals> {
    Ok(signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])?)
}

/// Triggers `handle` on the `signals` from [`stop_signals`] (SIGTERM or SIGINT). A
/// broker following a control plane first drains: the shards it leads are handed to
/// caught-up replicas (see [`Cluster::drain`](crate::cluster::Cluster::drain)) while it
/// keeps serving.
pub fn shutdown_on_signals(
    mut signals: signal_hook::iterator::Signals,
    handle: ShutdownHandle,
    cluster: Option<Arc<crate::cluster::Cluster>>,
) -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("felix-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!(signal = sig, "signal received: draining");
                if let Some(c) = &cluster {
                    c.drain(DRAIN_PATIENCE);
                }
                handle.trigger();
            }
        })?;
    Ok(())
}
