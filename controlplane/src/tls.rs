//! HTTPS for the API: a rustls acceptor in front of axum.
//!
//! TLS handshakes run in tasks of their own (bounded by [`HANDSHAKE_TIMEOUT`]), so a
//! client that stalls mid-handshake never holds up the next one; finished connections
//! reach axum through a channel that looks to it like any listener. At most
//! [`HANDSHAKES_MAX`] connections are handshaking or handshaken and waiting for room in
//! that channel (64) while the server has none (see [`crate::bounded`]); past it the
//! acceptor waits.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// Longest a client may take to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections accepted and not yet taken by the server, at most.
pub const HANDSHAKES_MAX: usize = 256;

/// A certificate chain and its key, PEM.
#[derive(Clone)]
pub struct ServerTls {
    /// The chain, leaf first.
    pub cert_pem: Vec<u8>,
    /// The leaf's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl ServerTls {
    /// Reads both files.
    pub fn from_files(cert: &std::path::Path, key: &std::path::Path) -> anyhow::Result<ServerTls> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))
        };
        Ok(ServerTls {
            cert_pem: read(cert)?,
            key_pem: read(key)?,
        })
    }

    /// The rustls configuration (TLS 1.2 and 1.3, ring).
    pub fn config(&self) -> anyhow::Result<Arc<rustls::ServerConfig>> {
        let chain = CertificateDer::pem_slice_iter(&self.cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("TLS certificate: {e}"))?;
        if chain.is_empty() {
            anyhow::bail!("TLS certificate file holds no CERTIFICATE block");
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key_pem)
            .map_err(|e| anyhow::anyhow!("TLS key: {e}"))?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| anyhow::anyhow!("TLS certificate and key: {e}"))?;
        Ok(Arc::new(config))
    }
}

/// Accepted, handshaken connections.
pub struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TlsListener {
    /// Starts accepting on `tcp` (on the current tokio runtime).
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let addr = tcp.local_addr()?;
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let tls = TlsAcceptor::from(config);
        let slots = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_MAX));
        let acceptor = tokio::spawn(async move {
            loop {
                let slot = slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("the semaphore is never closed");
                let (stream, peer) = match tcp.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (tls, tx) = (tls.clone(), tx.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener {
            ready,
            addr,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The acceptor ended (only at shutdown): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.addr)
    }
}
