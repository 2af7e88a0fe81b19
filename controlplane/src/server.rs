//! Running the service: open the store, serve the API, run placement on a timer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::api::{self, ApiConfig, AppState};
use crate::pg::PgStore;
use crate::placement;
use crate::replication::ReplicaReports;
use crate::sealing::{KEK_BYTES, Keyring};
use crate::store::{MemoryStore, Store};
use crate::tls::{ServerTls, TlsListener};

/// Where metadata lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// In process; lost on exit (dev, tests).
    Memory,
    /// A Postgres URL (`postgres://user@host/db`).
    Postgres(String),
}

impl std::str::FromStr for StoreConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "memory" {
            Ok(StoreConfig::Memory)
        } else if s.starts_with("postgres://")
            || s.starts_with("postgresql://")
            || s.contains("host=")
        {
            Ok(StoreConfig::Postgres(s.to_owned()))
        } else {
            Err(format!("{s:?}: expected `memory` or a postgres:// URL"))
        }
    }
}

/// Service settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// HTTP address.
    pub listen: SocketAddr,
    /// Metadata store.
    pub store: StoreConfig,
    /// API settings (bootstrap token, heartbeat timing).
    pub api: ApiConfig,
    /// Time between placement passes.
    pub placement_interval: Duration,
    /// The key-encryption keys that seal tenants' signing keys at rest.
    pub keys: KeySource,
    /// Serve HTTPS with this certificate.
    pub tls: Option<ServerTls>,
    /// Serve plain HTTP on an address that is not loopback (warned about at start).
    pub insecure_http: bool,
}

/// Where the key-encryption keys (KEKs) come from.
#[derive(Debug, Clone, Default)]
pub enum KeySource {
    /// A random KEK made at start and never written down: signing keys in a persistent
    /// store would not open after a restart, so only the in-memory store may use it.
    #[default]
    Ephemeral,
    /// KEK material: the current one (seals) and previous ones (still open).
    Material {
        /// Seals and opens.
        current: [u8; KEK_BYTES],
        /// Only opens (a rotation in progress).
        previous: Vec<[u8; KEK_BYTES]>,
    },
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: ([127, 0, 0, 1], 7070).into(),
            store: StoreConfig::Memory,
            api: ApiConfig::default(),
            placement_interval: Duration::from_millis(1000),
            keys: KeySource::Ephemeral,
            tls: None,
            insecure_http: false,
        }
    }
}

/// A running control plane.
#[derive(Debug)]
pub struct Running {
    /// The bound address.
    pub addr: SocketAddr,
    /// `https` or `http`.
    pub scheme: &'static str,
    /// The store it serves.
    pub store: Arc<dyn Store>,
    /// The replica reports its API keeps and its placement pass reads.
    pub reports: ReplicaReports,
    stop: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    placement: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops serving and placing.
    pub async fn stop(self) {
        self.stop_within(STOP_GRACE).await;
    }

    /// [`Running::stop`], waiting `grace` for connections to finish.
    pub async fn stop_within(self, grace: std::time::Duration) {
        let _ = self.stop.send(true);
        // Connections finish what they are answering; a long poll does not hold the
        // stop for good (aborting the server closes every connection).
        let mut server = self.server;
        if tokio::time::timeout(grace, &mut server).await.is_err() {
            tracing::warn!("connections still open {grace:?} into the stop: closed");
            server.abort();
        }
        self.placement.abort();
        let _ = self.placement.await;
    }
}

/// How long a stop waits for connections to finish before it closes them.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens the configured store.
pub async fn open_store(config: &StoreConfig) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match config {
        StoreConfig::Memory => Arc::new(MemoryStore::new()),
        StoreConfig::Postgres(url) => Arc::new(PgStore::connect(url).await?),
    })
}

/// Starts serving on the current tokio runtime.
pub async fn start(config: ServerConfig) -> anyhow::Result<Running> {
    if matches!(config.store, StoreConfig::Postgres(_))
        && matches!(config.keys, KeySource::Ephemeral)
    {
        anyhow::bail!(
            "a Postgres store needs a key-encryption key (key_encryption_key_file or \
             FELIX_CONTROLPLANE_KEK_FILE): tenants' signing keys are stored sealed with it"
        );
    }
    let store = open_store(&config.store).await?;
    start_with_store(config, store).await
}

/// Starts serving over an already opened store.
pub async fn start_with_store(
    config: ServerConfig,
    store: Arc<dyn Store>,
) -> anyhow::Result<Running> {
    // As the configuration checks it (a broker's lease runs 3/4 of the expiry from each
    // heartbeat), for services built in code too.
    if config.api.expiry_timeout < config.api.heartbeat_interval * 2 {
        anyhow::bail!(
            "expiry timeout ({:?}) must be at least twice the heartbeat interval ({:?})",
            config.api.expiry_timeout,
            config.api.heartbeat_interval
        );
    }
    config.api.check_margin().map_err(|m| anyhow::anyhow!(m))?;
    let keyring = Arc::new(match &config.keys {
        KeySource::Ephemeral => Keyring::ephemeral(),
        KeySource::Material { current, previous } => Keyring::new(current, previous),
    });
    let resealed = api::reseal_keys(store.as_ref(), &keyring)
        .await
        .map_err(|e| anyhow::anyhow!("sealing signing keys: {e}"))?;
    if resealed > 0 {
        tracing::info!(
            resealed,
            kek = keyring.current_id(),
            "signing keys sealed with the current key-encryption key"
        );
    }
    let tls = config.tls.as_ref().map(ServerTls::config).transpose()?;
    if tls.is_none() && !config.listen.ip().is_loopback() {
        if !config.insecure_http {
            anyhow::bail!(
                "refusing plain HTTP on {}: brokers would take verification keys and \
                 assignments from it unprotected. Configure tls_cert_file and tls_key_file, \
                 listen on loopback, or set insecure_http",
                config.listen
            );
        }
        tracing::warn!(listen = %config.listen, "serving plain HTTP off loopback (insecure_http): keys and assignments travel unprotected");
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    let reports = ReplicaReports::new();
    let state = AppState {
        store: store.clone(),
        config: config.api.clone(),
        reports: reports.clone(),
        keyring,
        counted: Default::default(),
        audited: Default::default(),
        auditing: Default::default(),
    };
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let app = api::router(state);
    let scheme = if tls.is_some() { "https" } else { "http" };
    let server = match tls {
        Some(tls) => {
            let listener = TlsListener::new(listener, tls)?;
            tokio::spawn(crate::bounded::serve(
                listener,
                app,
                crate::bounded::API,
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            ))
        }
        None => tokio::spawn(crate::bounded::serve(
            listener,
            app,
            crate::bounded::API,
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            },
        )),
    };
    let placement = {
        let (store, api, every) = (store.clone(), config.api.clone(), config.placement_interval);
        let reports = reports.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match placement::pass(store.as_ref(), &api, &reports).await {
                    Ok(r) if r != placement::PassReport::default() => {
                        tracing::info!(?r, "placement pass")
                    }
                    Ok(_) => {}
                    // A conflict means someone else wrote first; the next pass replans.
                    Err(e) => tracing::warn!(error = %e, "placement pass"),
                }
            }
        })
    };
    let backend = match config.store {
        StoreConfig::Memory => "memory",
        StoreConfig::Postgres(_) => "postgres",
    };
    tracing::info!(%addr, scheme, backend, "control plane serving");
    Ok(Running {
        addr,
        scheme,
        store,
        reports,
        stop,
        server,
        placement,
    })
}
