//! QUIC on quinn-proto, driven from the per-core executors (see [`driver`]), and the TLS
//! and transport settings every Felix endpoint uses.
//!
//! Connections map to cores by the kernel: every core binds the broker port with
//! `SO_REUSEPORT`, and the kernel hashes a client's address 4-tuple to one of those
//! sockets, so all of a connection's datagrams reach the core that accepted it (QUIC
//! connection migration to a new client address is therefore not supported across
//! cores). A request for a shard owned by another core is sent over the cross-core
//! mesh by the connection's core and answered back over it.

mod alpn;
pub mod driver;
mod udp;
mod windows;

use std::sync::Arc;
use std::time::Duration;

use quinn_proto::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn_proto::{IdleTimeout, TransportConfig, VarInt};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A QUIC client configuration (what [`Endpoint::connect`] takes).
pub use quinn_proto::{ClientConfig, ServerConfig};

pub use driver::{
    ConnId, Connection, Endpoint, EndpointOptions, EndpointStats, QuicError, RecvStream,
    SendStream, WindowBudget, missed_wakeups_total, send_errors_total,
};
pub use windows::{WINDOW_FLOOR_BYTES, reserved_per_connection};

/// The ALPN id Felix clients may offer; clients offering none are accepted too.
pub const ALPN: &[u8] = felix_wire::CLIENT_ALPN;

/// Errors building TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// rustls refused the certificate or key.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// No TLS 1.3 suite usable for QUIC.
    #[error("TLS configuration is not usable for QUIC: {0}")]
    Quic(String),
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Generate(String),
    /// PEM could not be parsed.
    #[error("PEM: {0}")]
    Pem(String),
}

/// Flow-control and stream limits: what bounds a peer's memory use on this side.
#[derive(Debug, Clone, Copy)]
pub struct TransportLimits {
    /// Concurrent streams the peer may open, per direction.
    pub max_streams: u32,
    /// Unread bytes buffered per stream.
    pub stream_window_bytes: u32,
    /// Unread bytes buffered per connection.
    pub connection_window_bytes: u32,
    /// Unacknowledged bytes we buffer for sending per connection.
    pub send_window_bytes: u64,
    /// A connection silent this long is closed (also bounds a stalled handshake). This
    /// side pings an idle peer three times per timeout, so a live peer that has nothing
    /// to say keeps its connection and a dead one loses it within the timeout.
    pub idle_timeout: Duration,
}

impl Default for TransportLimits {
    fn default() -> Self {
        Self {
            max_streams: 1024,
            stream_window_bytes: 8 << 20,
            connection_window_bytes: 32 << 20,
            send_window_bytes: 32 << 20,
            idle_timeout: Duration::from_secs(30),
        }
    }
}

impl TransportLimits {
    /// The quinn-proto transport config.
    pub fn transport(&self) -> TransportConfig {
        let mut t = TransportConfig::default();
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_streams))
            .max_concurrent_uni_streams(VarInt::from_u32(self.max_streams))
            .stream_receive_window(VarInt::from_u32(self.stream_window_bytes))
            .receive_window(VarInt::from_u32(self.connection_window_bytes))
            .send_window(self.send_window_bytes)
            .max_idle_timeout(IdleTimeout::try_from(self.idle_timeout).ok())
            .keep_alive_interval(Some(self.idle_timeout / 3))
            // Felix reads no unreliable datagrams: advertised, a peer's were buffered
            // (each holding its whole received packet) and never read.
            .datagram_receive_buffer_size(None);
        t
    }
}

/// The receive window (all streams together) a server gives a connection until the
/// application trusts it and widens it ([`Connection::set_receive_window`]): before its
/// peer proves who it is, this is all it can make us buffer, out-of-order data
/// included (a hole at a stream's start holds everything after it, unseen by the
/// application's bounds).
pub const UNTRUSTED_WINDOW_BYTES: u32 = 1 << 20;

/// The receive window a server gives a connection it accepts while many others are
/// not trusted yet (see [`crowded_server_config`]): room for the largest frame a
/// stream may send before it authenticates (64 KiB), twice.
pub const CROWDED_WINDOW_BYTES: u32 = 128 << 10;

/// Streams (each direction) a connection may open before it is trusted (see
/// [`Connection::set_max_streams`]). quinn-proto keeps each received datagram whole
/// behind any piece of it a stream holds out of order, up to about 32 KiB a stream
/// before it compacts them, whatever the window: a peer sending one byte past a hole on
/// every stream it may open held some 64 MiB a connection with 2,048 streams (1,024 each
/// way) for a few tens of kilobytes of credit, before proving who it was. 64 covers the
/// streams a client opens on a connection before its first stream authenticates.
pub const UNTRUSTED_STREAMS: u32 = 64;

/// Streams each way a connection may open before it is trusted, given `max` after: at
/// most [`UNTRUSTED_STREAMS`], and more than `max / 8` below `max` (when raised at all),
/// since quinn-proto announces a raise at once only past that.
fn untrusted_streams(max: u32) -> u32 {
    if max <= UNTRUSTED_STREAMS {
        max
    } else {
        UNTRUSTED_STREAMS.min(max - (max / 8 + 1))
    }
}

/// Ack-eliciting packets a client may receive from us before it must acknowledge
/// them at once (QUIC's ACK frequency extension, which quinn clients accept; without it
/// a client acknowledges every second packet). An answer of two packets (a cache value
/// or a record of a kibibyte or more) made the client send an ACK of its own, one more
/// datagram for us to receive and one more wake-up of the core per request; at three,
/// the ACK rides on the client's next request. A sender whose congestion window holds
/// fewer packets than the peer waits for gets no ACK until the peer's ACK delay
/// ([`PEER_MAX_ACK_DELAY`]): four packets (about 6 KB) fit quinn's initial window
/// (12,000 bytes), but not the window left after several losses (down to two
/// packets), which a sender with little to send does not grow back.
pub const PEER_ACK_ELICITING_THRESHOLD: u32 = 3;

/// The longest a client may hold an ACK back (it would take 25 ms of its own). It bounds
/// the stall a sender whose window shrank below four packets waits for each ACK, and
/// our loss timer (which allows for the peer's ACK delay) shrinks with it. A client
/// idle for longer between requests acknowledges an answer on its own, as it did
/// before after 25 ms.
pub const PEER_MAX_ACK_DELAY: Duration = Duration::from_millis(5);

/// Asks the peer to acknowledge every [`PEER_ACK_ELICITING_THRESHOLD`]` + 1`-th
/// ack-eliciting packet or after [`PEER_MAX_ACK_DELAY`], instead of every second one,
/// and still at once on a gap in our packet numbers, as without the extension (its
/// default, 2, let the loss of an answer's first packet wait for the ACK delay).
fn ask_fewer_acks(t: &mut TransportConfig) {
    let mut f = quinn_proto::AckFrequencyConfig::default();
    f.ack_eliciting_threshold(VarInt::from_u32(PEER_ACK_ELICITING_THRESHOLD))
        .max_ack_delay(Some(PEER_MAX_ACK_DELAY))
        .reordering_threshold(VarInt::from_u32(1));
    t.ack_frequency_config(Some(f));
}

/// `config` for connections accepted while many others are untrusted: their receive
/// window starts at [`CROWDED_WINDOW_BYTES`]. Each untrusted connection could make us
/// buffer [`UNTRUSTED_WINDOW_BYTES`] without credentials (out-of-order data behind a
/// hole is unseen by the application's bounds), so ten thousand of them a core held
/// some 10 GiB.
pub fn crowded_server_config(config: &ServerConfig, limits: &TransportLimits) -> ServerConfig {
    let mut crowded = config.clone();
    let mut t = server_transport(limits);
    t.receive_window(VarInt::from_u32(
        limits.connection_window_bytes.min(CROWDED_WINDOW_BYTES),
    ));
    crowded.transport_config(Arc::new(t));
    crowded
}

/// `limits`' transport config for a server: the connection's receive window starts at
/// [`UNTRUSTED_WINDOW_BYTES`], and its streams at [`UNTRUSTED_STREAMS`] each way.
fn server_transport(limits: &TransportLimits) -> TransportConfig {
    let mut t = limits.transport();
    t.receive_window(VarInt::from_u32(
        limits.connection_window_bytes.min(UNTRUSTED_WINDOW_BYTES),
    ));
    let streams = VarInt::from_u32(untrusted_streams(limits.max_streams));
    t.max_concurrent_bidi_streams(streams)
        .max_concurrent_uni_streams(streams);
    ask_fewer_acks(&mut t);
    t
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server config for the given certificate chain and key, accepting ALPN `felix/1`
/// or no ALPN.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    limits: TransportLimits,
) -> Result<ServerConfig, TlsError> {
    let without = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    let mut with = without.clone();
    // Ours first: a forwarding broker offering both is known as one (rustls picks the
    // server's first that the client offers); a client offering `felix/1` gets it.
    with.alpn_protocols = vec![
        felix_wire::internal::FORWARD_AGAIN_ALPN.to_vec(),
        felix_wire::internal::FORWARD_ALPN.to_vec(),
        ALPN.to_vec(),
    ];
    let quic = |tls: rustls::ServerConfig| {
        QuicServerConfig::try_from(tls)
            .map(|q| Arc::new(q) as Arc<dyn quinn_proto::crypto::ServerConfig>)
            .map_err(|e| TlsError::Quic(e.to_string()))
    };
    let either = alpn::EitherAlpn {
        with_alpn: quic(with)?,
        without_alpn: quic(without)?,
    };
    let mut config = ServerConfig::with_crypto(Arc::new(either));
    config.transport_config(Arc::new(server_transport(&limits)));
    // A connection stays on the 4-tuple it began on (another one's packets land on
    // another core anyway): with migration allowed, a packet from a forged address
    // was answered there with a 1,200-byte padded path challenge (and a probing one
    // with a path response), ~30 times its size, past QUIC's 3x bound.
    config.migration(false);
    Ok(config)
}

/// A server config for the broker-to-broker listener: ALPN `felix-internal/1` only,
/// so a client connection can never land on it by mistake.
pub fn internal_server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    limits: TransportLimits,
) -> Result<ServerConfig, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    tls.alpn_protocols = vec![felix_wire::internal::INTERNAL_ALPN.to_vec()];
    let quic = QuicServerConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = ServerConfig::with_crypto(Arc::new(quic));
    // Peers speak on streams they open one way (`accept_uni`): no bidirectional
    // streams, whose windows anyone reaching the port could fill before a hello.
    let mut transport = server_transport(&limits);
    transport.max_concurrent_bidi_streams(VarInt::from_u32(0));
    config.transport_config(Arc::new(transport));
    config.migration(false);
    Ok(config)
}

/// A client config for broker-to-broker connections: trusting `roots`, offering ALPN
/// `felix-internal/1`.
pub fn internal_client_config(
    roots: &[CertificateDer<'static>],
    limits: TransportLimits,
) -> Result<ClientConfig, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(r.clone())?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(store)
        .with_no_client_auth();
    tls.alpn_protocols = vec![felix_wire::internal::INTERNAL_ALPN.to_vec()];
    let quic = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = ClientConfig::new(Arc::new(quic));
    config.transport_config(Arc::new(limits.transport()));
    Ok(config)
}

/// A client config trusting `roots`, offering ALPN `felix/1` when `offer_alpn`.
pub fn client_config(
    roots: &[CertificateDer<'static>],
    offer_alpn: bool,
    limits: TransportLimits,
) -> Result<ClientConfig, TlsError> {
    let alpn = if offer_alpn {
        vec![ALPN.to_vec()]
    } else {
        Vec::new()
    };
    client_config_offering(roots, alpn, limits)
}

/// A client config for a broker forwarding requests to shard leaders: it offers
/// [`felix_wire::internal::FORWARD_ALPN`] (or, `again`, for requests forwarded to it,
/// [`felix_wire::internal::FORWARD_AGAIN_ALPN`]), then `felix/1` (a leader that does
/// not know the first picks the second).
pub fn forwarding_client_config(
    roots: &[CertificateDer<'static>],
    limits: TransportLimits,
    again: bool,
) -> Result<ClientConfig, TlsError> {
    let ours = if again {
        felix_wire::internal::FORWARD_AGAIN_ALPN
    } else {
        felix_wire::internal::FORWARD_ALPN
    };
    client_config_offering(roots, vec![ours.to_vec(), ALPN.to_vec()], limits)
}

fn client_config_offering(
    roots: &[CertificateDer<'static>],
    alpn: Vec<Vec<u8>>,
    limits: TransportLimits,
) -> Result<ClientConfig, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(r.clone())?;
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(store)
        .with_no_client_auth();
    tls.alpn_protocols = alpn;
    let quic = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = ClientConfig::new(Arc::new(quic));
    config.transport_config(Arc::new(limits.transport()));
    Ok(config)
}

/// A certificate authority and a leaf it signed, in DER and PEM.
#[derive(Debug, Clone)]
pub struct GeneratedCerts {
    /// The CA certificate (DER).
    pub ca_der: CertificateDer<'static>,
    /// The CA certificate (PEM), what clients trust.
    pub ca_pem: String,
    /// The leaf certificate (DER).
    pub cert_der: CertificateDer<'static>,
    /// The leaf certificate (PEM).
    pub cert_pem: String,
    /// The leaf's PKCS#8 key (DER).
    pub key_der: Vec<u8>,
    /// The leaf's key (PEM).
    pub key_pem: String,
}

impl GeneratedCerts {
    /// The leaf key as rustls wants it.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

/// Creates a CA and a server certificate for `names` signed by it.
pub fn generate_certs(names: &[&str]) -> Result<GeneratedCerts, TlsError> {
    let err = |e: rcgen::Error| TlsError::Generate(e.to_string());
    let ca_key = rcgen::KeyPair::generate().map_err(err)?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "Felix dev CA");
    let ca = ca_params.self_signed(&ca_key).map_err(err)?;
    let leaf_key = rcgen::KeyPair::generate().map_err(err)?;
    let mut leaf_params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .map_err(err)?;
    leaf_params.distinguished_name.push(
        rcgen::DnType::CommonName,
        names.first().copied().unwrap_or("felix"),
    );
    let leaf = leaf_params
        .signed_by(&leaf_key, &ca, &ca_key)
        .map_err(err)?;
    Ok(GeneratedCerts {
        ca_der: ca.der().clone(),
        ca_pem: ca.pem(),
        cert_der: leaf.der().clone(),
        cert_pem: leaf.pem(),
        key_der: leaf_key.serialize_der(),
        key_pem: leaf_key.serialize_pem(),
    })
}

/// Parses every certificate in a PEM text.
pub fn certs_from_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let mut out = Vec::new();
    for item in pem_blocks(pem, "CERTIFICATE")? {
        out.push(CertificateDer::from(item));
    }
    if out.is_empty() {
        return Err(TlsError::Pem("no CERTIFICATE block".into()));
    }
    Ok(out)
}

/// Parses a PKCS#8 private key from PEM.
pub fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    let der = pem_blocks(pem, "PRIVATE KEY")?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::Pem("no PRIVATE KEY block".into()))?;
    Ok(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(der)))
}

fn pem_blocks(pem: &str, label: &str) -> Result<Vec<Vec<u8>>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let _ = label;
    let mut out = Vec::new();
    for section in rustls::pki_types::pem::PemObject::pem_slice_iter(pem.as_bytes()) {
        let section: CertOrKey = section.map_err(|e| TlsError::Pem(e.to_string()))?;
        match (section, label) {
            (CertOrKey::Cert(der), "CERTIFICATE") => out.push(der),
            (CertOrKey::Key(der), "PRIVATE KEY") => out.push(der),
            _ => {}
        }
    }
    let _ = <CertificateDer<'static> as PemObject>::from_pem_slice;
    Ok(out)
}

enum CertOrKey {
    Cert(Vec<u8>),
    Key(Vec<u8>),
}

impl rustls::pki_types::pem::PemObject for CertOrKey {
    fn from_pem(kind: rustls::pki_types::pem::SectionKind, der: Vec<u8>) -> Option<Self> {
        match kind {
            rustls::pki_types::pem::SectionKind::Certificate => Some(CertOrKey::Cert(der)),
            rustls::pki_types::pem::SectionKind::PrivateKey => Some(CertOrKey::Key(der)),
            _ => None,
        }
    }
}
