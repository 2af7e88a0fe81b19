//! Client configuration: defaults, then `FELIX_*` environment, then a YAML file.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::error::ClientError;

/// Supplies a token every time a stream authenticates (for tokens that expire).
pub trait TokenProvider: Send + Sync + std::fmt::Debug {
    /// The current token.
    fn token(&self) -> Result<String, ClientError>;
}

/// Everything a client needs to talk to brokers.
#[derive(Clone)]
pub struct ClientConfig {
    /// QUIC/TLS settings (see [`quic_client_config`]).
    pub quinn: quinn::ClientConfig,
    /// The tenant every stream authenticates as (required).
    pub auth_tenant_id: Option<String>,
    /// A static token.
    pub auth_token: Option<String>,
    /// A token source; wins over `auth_token`.
    pub token_provider: Option<Arc<dyn TokenProvider>>,
    /// Largest frame payload accepted.
    pub max_frame_bytes: usize,
    /// Acked publishes in flight per connection (its one publish stream); one past it
    /// waits for an ack. The broker's advertised window applies when smaller.
    pub publish_window: usize,
    /// How long a request may wait for its answer before the connection is suspect.
    pub request_timeout: Duration,
    /// Client-side queue of a subscription (events) or a cache watch (changes).
    pub client_sub_queue_capacity: usize,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("auth_tenant_id", &self.auth_tenant_id)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("publish_window", &self.publish_window)
            .finish()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlConfig {
    auth_tenant_id: Option<String>,
    auth_token: Option<String>,
    max_frame_bytes: Option<usize>,
    publish_window: Option<usize>,
    request_timeout_ms: Option<u64>,
    client_sub_queue_capacity: Option<usize>,
}

fn env_num(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.parse().ok().filter(|n| *n > 0)
}

impl ClientConfig {
    /// Defaults with no credentials.
    pub fn optimized_defaults(quinn: quinn::ClientConfig) -> ClientConfig {
        ClientConfig {
            quinn,
            auth_tenant_id: None,
            auth_token: None,
            token_provider: None,
            max_frame_bytes: 16 << 20,
            publish_window: 256,
            request_timeout: Duration::from_secs(30),
            client_sub_queue_capacity: 256,
        }
    }

    /// Defaults, then `FELIX_*` environment (`FELIX_AUTH_TENANT`, `FELIX_AUTH_TOKEN`,
    /// `FELIX_MAX_FRAME_BYTES`, `FELIX_PUBLISH_WINDOW`, `FELIX_CLIENT_SUB_QUEUE_CAPACITY`),
    /// then YAML from `path` or `FELIX_CLIENT_CONFIG`. A named file that cannot be read
    /// or parsed is an error; zero or unparsable numbers in the environment are ignored.
    pub fn from_env_or_yaml(
        quinn: quinn::ClientConfig,
        path: Option<&str>,
    ) -> anyhow::Result<ClientConfig> {
        let mut c = Self::optimized_defaults(quinn);
        if let Ok(t) = std::env::var("FELIX_AUTH_TENANT") {
            c.auth_tenant_id = Some(t);
        }
        if let Ok(t) = std::env::var("FELIX_AUTH_TOKEN") {
            c.auth_token = Some(t);
        }
        if let Some(n) = env_num("FELIX_MAX_FRAME_BYTES") {
            c.max_frame_bytes = n;
        }
        if let Some(n) = env_num("FELIX_PUBLISH_WINDOW") {
            c.publish_window = n;
        }
        if let Some(n) = env_num("FELIX_CLIENT_SUB_QUEUE_CAPACITY") {
            c.client_sub_queue_capacity = n;
        }
        let path = path
            .map(str::to_owned)
            .or_else(|| std::env::var("FELIX_CLIENT_CONFIG").ok());
        if let Some(path) = path {
            let text =
                std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            let y: YamlConfig =
                serde_yaml::from_str(&text).map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
            c.auth_tenant_id = y.auth_tenant_id.or(c.auth_tenant_id);
            c.auth_token = y.auth_token.or(c.auth_token);
            c.max_frame_bytes = y.max_frame_bytes.unwrap_or(c.max_frame_bytes);
            c.publish_window = y.publish_window.unwrap_or(c.publish_window);
            c.request_timeout = y
                .request_timeout_ms
                .map_or(c.request_timeout, Duration::from_millis);
            c.client_sub_queue_capacity = y
                .client_sub_queue_capacity
                .unwrap_or(c.client_sub_queue_capacity);
        }
        Ok(c)
    }

    pub(crate) fn token(&self) -> Result<String, ClientError> {
        match (&self.token_provider, &self.auth_token) {
            (Some(p), _) => p.token(),
            (None, Some(t)) => Ok(t.clone()),
            (None, None) => Ok(String::new()),
        }
    }

    pub(crate) fn tenant(&self) -> Result<&str, ClientError> {
        self.auth_tenant_id
            .as_deref()
            .ok_or_else(|| ClientError::Config("auth_tenant_id is required".into()))
    }
}

/// A QUIC client config verifying brokers with `roots` (PEM certificates), offering ALPN
/// `felix/1` only when asked (very old brokers refuse any ALPN). Verification cannot be
/// turned off.
pub fn quic_client_config(
    roots_pem: &str,
    offer_alpn: bool,
) -> anyhow::Result<quinn::ClientConfig> {
    let mut store = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
        store.add(cert.map_err(|e| anyhow::anyhow!("CA PEM: {e}"))?)?;
    }
    anyhow::ensure!(!store.is_empty(), "no certificate in the CA PEM");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(store)
        .with_no_client_auth();
    if offer_alpn {
        tls.alpn_protocols = vec![felix_wire::CLIENT_ALPN.to_vec()];
    }
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    let mut transport = quinn::TransportConfig::default();
    transport
        .keep_alive_interval(Some(Duration::from_secs(2)))
        .max_idle_timeout(Some(quinn::IdleTimeout::try_from(Duration::from_secs(6))?))
        .stream_receive_window(quinn::VarInt::from_u32(64 << 20))
        .receive_window(quinn::VarInt::from_u32(256 << 20));
    config.transport_config(Arc::new(transport));
    Ok(config)
}

/// Reads a PEM file of CA certificates into a client config.
pub fn quic_client_config_from_file(
    path: &std::path::Path,
    offer_alpn: bool,
) -> anyhow::Result<quinn::ClientConfig> {
    let pem =
        std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    quic_client_config(&pem, offer_alpn)
}
