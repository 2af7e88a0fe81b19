//! The broker-to-broker transport of one core: the only sockets in `replication/`.
//!
//! Outbound, each core keeps one QUIC connection per peer (ALPN `felix-internal/1`) with
//! one unidirectional stream that opens with `Hello` (our node id and node token) and
//! then carries frames in order. A bounded queue sits in front of it; when it is full,
//! frames are dropped, which the replication protocol tolerates (every request is sent
//! again after a timeout). Inbound, connections land on whichever core the kernel picks;
//! every stream must open with a `Hello` whose node token the control plane signed for
//! that node id (unless the operator explicitly allows unauthenticated peers), and its
//! frames are handed to the broker, which routes each to the core that owns the shard.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use felix_core_runtime::quic::{ClientConfig, Connection, Endpoint, EndpointOptions};
use felix_core_runtime::{clock, task};
use felix_wire::internal::{self, Hello, InternalMessage, InternalReader};
use felix_wire::token::CONTROLPLANE_AUDIENCE;

use super::machine::NodeId;
use crate::auth::{Grant, TenantKeys};

/// Bytes queued for one peer before frames are dropped.
const QUEUE_BYTES_MAX: usize = 64 << 20;
/// The tenant whose keys sign node tokens.
const OPERATOR_TENANT: &str = "operator";
/// Skew allowed past a node token's expiry, as at its verification.
const TOKEN_SKEW_SECS: u64 = 60;

/// Frames waiting for one peer's stream.
#[derive(Debug, Default)]
struct PeerQueue {
    frames: RefCell<VecDeque<Bytes>>,
    bytes: Cell<usize>,
    waker: RefCell<Option<Waker>>,
    dead: Cell<bool>,
}

impl PeerQueue {
    fn push(&self, frame: Bytes) -> bool {
        if self.bytes.get() + frame.len() > QUEUE_BYTES_MAX {
            return false;
        }
        self.bytes.set(self.bytes.get() + frame.len());
        self.frames.borrow_mut().push_back(frame);
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
        true
    }

    async fn take_all(&self, out: &mut Vec<Bytes>) {
        poll_fn(|cx| {
            let mut q = self.frames.borrow_mut();
            if q.is_empty() {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                return Poll::Pending;
            }
            out.extend(q.drain(..));
            self.bytes.set(0);
            Poll::Ready(())
        })
        .await
    }
}

/// One core's outbound connections to peers.
pub struct Outbound {
    hello: Bytes,
    endpoint: Endpoint,
    config: ClientConfig,
    server_name: String,
    peers: RefCell<HashMap<NodeId, Rc<PeerQueue>>>,
    /// Frames dropped at a full queue or a dead connection.
    pub dropped: Cell<u64>,
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound")
            .field("peers", &self.peers.borrow().len())
            .finish()
    }
}

impl Outbound {
    /// This core's client endpoint for node `me` with `token`: an ephemeral port on
    /// `local` (the internal listener's address), so peer traffic leaves from the
    /// interface operators gave it.
    pub fn bind(
        local: std::net::IpAddr,
        me: &str,
        token: &str,
        config: ClientConfig,
        server_name: String,
    ) -> std::io::Result<Outbound> {
        let endpoint = Endpoint::bind(
            std::net::SocketAddr::new(local, 0),
            EndpointOptions {
                server: None,
                crowded_server: None,
                max_connections: 1024,
                reuse_port: false,
                reset_secret: None,
                on_sent: None,
                windows: None,
            },
        )?;
        let mut hello = BytesMut::new();
        InternalMessage::Hello(Hello {
            correlation_id: 0,
            node_id: me.to_owned(),
            token: token.to_owned(),
            capabilities: internal::capabilities::FENCE | internal::capabilities::FETCH,
        })
        .encode(&mut hello)
        .map_err(|e| std::io::Error::other(format!("encoding hello: {e}")))?;
        Ok(Outbound {
            hello: hello.freeze(),
            endpoint,
            config,
            server_name,
            peers: RefCell::default(),
            dropped: Cell::new(0),
        })
    }

    /// Queues `frame` for `to` at `addr`, connecting if needed. Never waits.
    pub fn send(&self, to: &NodeId, addr: SocketAddr, frame: Bytes) {
        let queue = {
            let mut peers = self.peers.borrow_mut();
            match peers.get(to) {
                Some(q) if !q.dead.get() => q.clone(),
                _ => {
                    let q = Rc::new(PeerQueue::default());
                    peers.insert(to.clone(), q.clone());
                    task::spawn(run_peer(
                        q.clone(),
                        self.endpoint.clone(),
                        self.config.clone(),
                        self.server_name.clone(),
                        addr,
                        self.hello.clone(),
                    ))
                    .detach();
                    q
                }
            }
        };
        if !queue.push(frame) {
            self.dropped.set(self.dropped.get() + 1);
        }
    }
}

async fn run_peer(
    queue: Rc<PeerQueue>,
    endpoint: Endpoint,
    config: ClientConfig,
    server_name: String,
    addr: SocketAddr,
    hello: Bytes,
) {
    let result = async {
        let conn = endpoint
            .connect(config, addr, &server_name)
            .await
            .map_err(|e| e.to_string())?;
        let mut stream = conn.open_uni().await.map_err(|e| e.to_string())?;
        stream.write_chunk(hello).await.map_err(|e| e.to_string())?;
        let mut frames = Vec::new();
        loop {
            queue.take_all(&mut frames).await;
            stream
                .write_chunks(&mut frames)
                .await
                .map_err(|e| e.to_string())?;
            frames.clear();
        }
        #[allow(unreachable_code)]
        Ok::<(), String>(())
    }
    .await;
    if let Err(e) = result {
        tracing::debug!(peer = %addr, error = %e, "peer connection ended");
    }
    queue.dead.set(true);
    queue.frames.borrow_mut().clear();
}

/// Who may talk to this broker's replication listener.
#[derive(Debug, Clone)]
pub struct PeerAuth {
    /// Verification keys (the operator tenant's sign node tokens).
    pub keys: Arc<ArcSwap<TenantKeys>>,
    /// Accept a `Hello` without checking its token (tests on one host only).
    pub allow_unauthenticated: bool,
}

impl PeerAuth {
    /// The node a `Hello` proves it is (a control-plane token for that node id), and
    /// the grant the token carries (none when unchecked).
    fn check(&self, hello: &Hello) -> Result<(NodeId, Option<Grant>), String> {
        if self.allow_unauthenticated {
            return Ok((hello.node_id.as_str().into(), None));
        }
        let grant = self
            .keys
            .load()
            .verify_for(
                &hello.token,
                OPERATOR_TENANT,
                clock::now().wall_secs(),
                CONTROLPLANE_AUDIENCE,
            )
            .map_err(|e| format!("node token: {e}"))?;
        if !grant.allows_object("node.manage", "node", &[&hello.node_id]) {
            return Err(format!(
                "the token does not name node {:?}",
                crate::error::cut(&hello.node_id)
            ));
        }
        Ok((hello.node_id.as_str().into(), Some(grant)))
    }
}

/// One inbound peer stream's authentication: its `Hello`'s node token, looked at again
/// whenever the verification keys change. A node token revoked by id, or signed by an
/// operator key since retired, ends the peer's streams at their next frame, as a
/// client's connection is closed; it was checked once, at the `Hello`.
struct PeerGate {
    auth: PeerAuth,
    grant: Option<Grant>,
    /// The key set the grant was last found holding under (held, so that no later set
    /// can take its address).
    seen: Option<Arc<TenantKeys>>,
}

impl PeerGate {
    fn new(auth: PeerAuth) -> Self {
        PeerGate {
            auth,
            grant: None,
            seen: None,
        }
    }

    fn hello(&mut self, hello: &Hello) -> Result<NodeId, String> {
        self.seen = Some(self.auth.keys.load_full());
        let (node, grant) = self.auth.check(hello)?;
        self.grant = grant;
        Ok(node)
    }

    /// `Err` with why once the key set changed and the grant no longer holds under it,
    /// or once the node token expired (at `now_secs`, wall clock; with the minute of
    /// skew a `Hello` is allowed). An expired token was looked at only at the `Hello`,
    /// so a link it opened outlived it.
    fn still_holds(&mut self, now_secs: u64) -> Result<(), String> {
        let Some(grant) = &self.grant else {
            return Ok(());
        };
        if grant.expires_at.saturating_add(TOKEN_SKEW_SECS) < now_secs {
            return Err(format!("node token expired at {}", grant.expires_at));
        }
        // Per chunk read: no reference count taken unless the set changed.
        let keys = self.auth.keys.load();
        if self.seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &keys)) {
            return Ok(());
        }
        let why = keys.revoked(grant);
        self.seen = Some(arc_swap::Guard::into_inner(keys));
        why.map_or(Ok(()), Err)
    }
}

/// Serves inbound peer connections on `endpoint` until it closes, handing every frame
/// after a valid `Hello` to `deliver` with the peer's node id.
pub async fn serve(
    endpoint: Endpoint,
    auth: PeerAuth,
    deliver: Rc<dyn Fn(NodeId, InternalMessage)>,
) {
    while let Some(conn) = endpoint.accept().await {
        let (auth, deliver) = (auth.clone(), deliver.clone());
        task::spawn(serve_connection(conn, auth, deliver)).detach();
    }
}

/// A connection none of whose streams said a good `Hello` within this is closed: a
/// peer opens its stream with one as soon as it connects.
const HELLO_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// What a connection's streams may send, together, before any of them said a good
/// `Hello` (each stream's own frame before it is bounded apart).
const BEFORE_HELLO_BYTES_MAX: usize = 1 << 20;

async fn serve_connection(
    conn: Connection,
    auth: PeerAuth,
    deliver: Rc<dyn Fn(NodeId, InternalMessage)>,
) {
    // Without these, anyone reaching the port held up to 64 KiB on each of a
    // connection's 1,024 streams for as long as it kept the connection alive: no
    // token needed (the client port has had both bounds).
    let heard = Rc::new(Cell::new(false));
    let unheard_bytes = Rc::new(Cell::new(0usize));
    {
        let (conn, heard) = (conn.clone(), heard.clone());
        task::spawn(async move {
            task::sleep(HELLO_DEADLINE).await;
            if !heard.get() {
                tracing::warn!("closing a peer connection that sent no hello in time");
                conn.close(1, b"no hello in time");
            }
        })
        .detach();
    }
    while let Ok(mut recv) = conn.accept_uni().await {
        let (auth, deliver, conn) = (auth.clone(), deliver.clone(), conn.clone());
        let (heard, unheard_bytes) = (heard.clone(), unheard_bytes.clone());
        task::spawn(async move {
            let mut reader = InternalReader::new(internal::PREHELLO_MAX_PAYLOAD_BYTES);
            let mut from: Option<NodeId> = None;
            let mut gate = PeerGate::new(auth);
            loop {
                match reader.next() {
                    Ok(Some(InternalMessage::Hello(h))) if from.is_none() => match gate.hello(&h) {
                        Ok(node) => {
                            from = Some(node);
                            if !heard.replace(true) {
                                // Trusted now: the receive window and streams it was
                                // held to open (peers open no bidirectional ones).
                                let limits = felix_core_runtime::quic::TransportLimits::default();
                                conn.set_receive_window(limits.connection_window_bytes);
                                conn.set_max_streams(0, limits.max_streams);
                            }
                            reader.set_max_payload_bytes(internal::DEFAULT_MAX_PAYLOAD_BYTES);
                        }
                        Err(e) => {
                            tracing::warn!(node = %crate::error::cut(&h.node_id), error = %e, "peer refused");
                            conn.close(2, b"peer not authenticated");
                            return;
                        }
                    },
                    Ok(Some(m)) => match &from {
                        Some(node) => deliver(node.clone(), m),
                        None => {
                            conn.close(2, b"hello first");
                            return;
                        }
                    },
                    Ok(None) => match recv.read_chunk(1 << 20).await {
                        Ok(Some(chunk)) => {
                            if !heard.get() {
                                let n = unheard_bytes.get() + chunk.len();
                                unheard_bytes.set(n);
                                if n > BEFORE_HELLO_BYTES_MAX {
                                    tracing::warn!("closing a peer connection that sent too much before a hello");
                                    conn.close(1, b"too much before hello");
                                    return;
                                }
                            }
                            if let Err(why) = gate.still_holds(clock::now().wall_secs()) {
                                tracing::warn!(node = ?from, reason = %why, "closing a peer whose node token no longer holds");
                                conn.close(2, b"peer token revoked");
                                return;
                            }
                            reader.push(chunk);
                        }
                        _ => return,
                    },
                    Err(e) if e.is_fatal() => {
                        tracing::warn!(error = %e, "peer stream");
                        return;
                    }
                    Err(e) => tracing::debug!(error = %e, "malformed peer frame skipped"),
                }
            }
        })
        .detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Claims, SigningKey};

    fn node_token(key: &SigningKey, node: &str, jti: &str) -> String {
        key.sign(&Claims {
            iss: crate::auth::ISSUER.into(),
            aud: CONTROLPLANE_AUDIENCE.into(),
            sub: node.into(),
            tid: OPERATOR_TENANT.into(),
            iat: 0,
            exp: u64::MAX / 2,
            nbf: None,
            perms: vec![format!("node.manage:node:{node}")],
            jti: Some(jti.into()),
        })
    }

    /// A peer's node token is looked at again when the keys change: denied by id, or
    /// its key retired, the gate says so at the next frame; a change that leaves it
    /// holding, or no change, lets it on.
    #[test]
    fn a_peers_token_revoked_after_its_hello_stops_holding() {
        let key = SigningKey::generate("op1").unwrap();
        let mut keys = TenantKeys::default();
        keys.add(OPERATOR_TENANT, "op1", key.public_key());
        let shared = Arc::new(ArcSwap::from_pointee(keys.clone()));
        let auth = PeerAuth {
            keys: shared.clone(),
            allow_unauthenticated: false,
        };
        let hello = |node: &str, jti: &str| Hello {
            correlation_id: 1,
            node_id: node.into(),
            token: node_token(&key, node, jti),
            capabilities: 0,
        };
        let mut gate = PeerGate::new(auth.clone());
        assert_eq!(
            gate.hello(&hello("node-b", "n-1")).unwrap(),
            "node-b".into()
        );
        assert!(gate.still_holds(0).is_ok(), "nothing changed");
        // Another token denied: still holds.
        let mut other = keys.clone();
        other.deny(OPERATOR_TENANT, "n-9");
        shared.store(Arc::new(other.clone()));
        assert!(gate.still_holds(0).is_ok());
        // This one denied: it stops holding.
        other.deny(OPERATOR_TENANT, "n-1");
        shared.store(Arc::new(other));
        assert!(gate.still_holds(0).unwrap_err().contains("n-1"));
        // Its key retired: a fresh gate's grant stops holding too.
        shared.store(Arc::new(keys.clone()));
        let mut gate = PeerGate::new(auth);
        gate.hello(&hello("node-c", "n-2")).unwrap();
        shared.store(Arc::new(TenantKeys::default()));
        assert!(gate.still_holds(0).unwrap_err().contains("op1"));
    }

    /// A node token that expires after its `Hello` stops holding at the next frame
    /// past its expiry (and the minute of skew).
    #[test]
    fn a_peers_token_stops_holding_once_it_expires() {
        let key = SigningKey::generate("op1").unwrap();
        let mut keys = TenantKeys::default();
        keys.add(OPERATOR_TENANT, "op1", key.public_key());
        let auth = PeerAuth {
            keys: Arc::new(ArcSwap::from_pointee(keys)),
            allow_unauthenticated: false,
        };
        let now = clock::now().wall_secs();
        let exp = now + 30;
        let token = key.sign(&Claims {
            iss: crate::auth::ISSUER.into(),
            aud: CONTROLPLANE_AUDIENCE.into(),
            sub: "node-b".into(),
            tid: OPERATOR_TENANT.into(),
            iat: 0,
            exp,
            nbf: None,
            perms: vec!["node.manage:node:node-b".into()],
            jti: Some("n-1".into()),
        });
        let mut gate = PeerGate::new(auth);
        gate.hello(&Hello {
            correlation_id: 1,
            node_id: "node-b".into(),
            token,
            capabilities: 0,
        })
        .unwrap();
        assert!(gate.still_holds(exp).is_ok());
        assert!(gate.still_holds(exp + TOKEN_SKEW_SECS).is_ok());
        assert!(
            gate.still_holds(exp + TOKEN_SKEW_SECS + 1)
                .unwrap_err()
                .contains("expired")
        );
    }
}
