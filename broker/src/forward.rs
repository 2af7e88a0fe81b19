//! Forwarding requests for shards another broker leads.
//!
//! Publishes and cache operations that reach a broker which does not lead the shard
//! are sent on to the leader over the ordinary client protocol, authenticated with the
//! client's own token (so the leader re-checks the permission), and the leader's answer
//! is relayed. The leader answers for itself. Forwarding connections offer
//! [`felix_wire::internal::FORWARD_ALPN`] first, or for requests forwarded here
//! [`felix_wire::internal::FORWARD_AGAIN_ALPN`]: a request is forwarded at most twice (a
//! view trailing by a move reaches the leader through a broker that has synced it), and
//! a broker that does not lead the shard of one forwarded twice refuses it retryably
//! (`shard_unavailable`): while two brokers' views of a shard disagreed, a request went
//! to and fro between them until the views agreed. Each core keeps
//! its own client endpoint and one connection per peer and revocable token identity
//! ([`Holder`]); a request uses a fresh stream.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use felix_core_runtime::quic::{
    ClientConfig, Connection, Endpoint, EndpointOptions, RecvStream, TransportLimits,
};
use felix_core_runtime::task;
use felix_wire::frame::{FrameHeader, FrameReader};
use felix_wire::{ErrorCode, Features, Flags, Frame, Message};

use crate::auth::Grant;
use crate::error::BrokerError;

/// Layouts a forwarding broker asks the leader to answer in: every ack detail, so
/// nothing is lost before the answer is re-encoded for the client.
const FORWARD_FLAGS: Flags = Flags(0x0001 | 0x0008 | 0x0010 | 0x0040 | 0x0200 | 0x0400 | 0x1000);

/// Features of the client's that shape a relayed answer, offered to the leader for it
/// (besides `ERROR_CODES`, always asked for): without `CACHE_CONDITIONAL` the leader
/// leaves a get's version out, and a client that asked for it got a value without it;
/// without `SEQUENCE_REUSED` the leader words that refusal as `invalid_request`, and a
/// client that reads it was told something its idempotent producer takes as in doubt.
pub const RELAYED_FEATURES: Features =
    Features(Features::CACHE_CONDITIONAL.0 | Features::SEQUENCE_REUSED.0);

/// How long a forwarded request may wait for its answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to a leader silent this long is closed, failing what waits on it. A
/// killed or frozen leader never closes its side, and the view keeps naming it until
/// the control plane declares it down (lease + margin, about two seconds): requests
/// forwarded in that window would otherwise wait out the whole answer timeout on a
/// connection that looks alive. A live leader answers the keep-alive pings (one per
/// second) from its QUIC driver however busy its shards are.
const PEER_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// The transport a core's forwarding connections use.
pub fn transport_limits() -> TransportLimits {
    TransportLimits {
        idle_timeout: PEER_IDLE_TIMEOUT,
        ..TransportLimits::default()
    }
}

/// One core's forwarding client.
pub struct Forwarder {
    /// For peers at IPv4 addresses.
    endpoint: Endpoint,
    /// For peers at IPv6 addresses, bound at the first (an IPv4 socket cannot reach them).
    endpoint_v6: RefCell<Option<Endpoint>>,
    /// For requests of clients, then for requests forwarded here (see
    /// [`felix_wire::internal::FORWARD_AGAIN_ALPN`]).
    config: [ClientConfig; 2],
    server_name: String,
    peers: RefCell<PeerTable<Connection>>,
    /// Bytes of requests this core has sent on each connection to a peer and not had
    /// answered (see [`SENT_MAX`]); a budget goes once nothing holds or waits for it.
    sent: RefCell<HashMap<PeerKey, FifoBudget>>,
    sent_waiters: RefCell<Vec<std::task::Waker>>,
}

/// Bytes of requests one core has sent on one connection to a peer and not had answered.
/// A leader closes a connection whose streams hold more than
/// `max_unfinished_frame_bytes_per_connection` (128 MiB by default) of unfinished frames,
/// and a forwarding core sends its clients' requests for one peer (and token identity)
/// on one connection: past this, the next forward on it waits for earlier ones to be
/// answered (a request the leader answered, it has read whole). One request larger than
/// this still goes alone. Requests owed no answer hold their bytes until they are
/// written. Per connection, as the bound it keeps: one budget for the core let a leader
/// slow to answer (a stalled disk, its pings still answered) hold every forward of the
/// core to the healthy ones for up to the answer timeout (until 2026-12-07).
const SENT_MAX: usize = 32 << 20;

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("peers", &self.peers.borrow().len())
            .finish()
    }
}

/// A connection to a peer no forward used for this long is closed (the next opens
/// another).
const PEER_UNUSED: Duration = Duration::from_secs(60);

/// Connections a core keeps to its peers. One is kept per leader and token identity, so
/// clients presenting many tokens would otherwise make as many, each held a minute past
/// its last use: at this many, the one used longest ago is let go for the next.
const PEERS_MAX: usize = 128;

/// Whose forwarded requests may share a connection to a leader: tokens a leader revokes
/// together. A leader closes a connection when a token that authenticated one of its
/// streams is denied by id or its signing key retired (`session::driver`), which fails
/// every request in flight on it; grants alike in the fields [`Grant::revoked_with`]
/// compares (tenant, key, token id) fall together, so nothing another token sent is lost
/// with them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Holder {
    tenant: String,
    kid: String,
    jti: Option<String>,
}

impl Holder {
    fn of(grant: &Grant) -> Holder {
        let Grant {
            tenant, kid, jti, ..
        } = grant;
        Holder {
            tenant: tenant.clone(),
            kid: kid.clone(),
            jti: jti.clone(),
        }
    }
}

/// A leader's address, the [`Holder`] whose requests a connection to it carries, and
/// whether they were forwarded here already.
type PeerKey = (SocketAddr, Holder, bool);

/// This core's connections to its peers, one per leader and [`Holder`]. One connection
/// per leader for every tenant let one tenant's revoked token fail the others' requests
/// in flight (until 2026-12-04, first per tenant: one token's revocation then failed its
/// tenant's other tokens' requests), and the leader's per-connection bounds were shared
/// alike. A connection unused for [`PEER_UNUSED`] is let go (it closes once no request
/// holds it). Sans-IO: the caller passes the time.
#[derive(Debug)]
struct PeerTable<C> {
    conns: HashMap<PeerKey, (C, Instant)>,
    swept: Option<Instant>,
}

impl<C: Clone> PeerTable<C> {
    fn new() -> Self {
        PeerTable {
            conns: HashMap::new(),
            swept: None,
        }
    }

    /// The connection for `key`, marked used at `now`.
    fn get(&mut self, key: &PeerKey, now: Instant) -> Option<C> {
        let (c, used) = self.conns.get_mut(key)?;
        *used = now;
        Some(c.clone())
    }

    /// Keeps `c` for `key`, letting go of the connection used longest ago when
    /// [`PEERS_MAX`] are kept already (returned; it closes once no request holds it).
    fn insert(&mut self, key: PeerKey, c: C, now: Instant) -> Option<C> {
        let mut evicted = None;
        if self.conns.len() >= PEERS_MAX && !self.conns.contains_key(&key) {
            let oldest = self
                .conns
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone());
            evicted = oldest.and_then(|k| self.conns.remove(&k)).map(|(c, _)| c);
        }
        self.conns.insert(key, (c, now));
        evicted
    }

    fn remove(&mut self, key: &PeerKey) {
        self.conns.remove(key);
    }

    /// The connections unused for [`PEER_UNUSED`] at `now`, taken out (looked for at
    /// most once every half of it).
    fn unused(&mut self, now: Instant) -> Vec<C> {
        if self
            .swept
            .is_some_and(|t| now.saturating_duration_since(t) < PEER_UNUSED / 2)
        {
            return Vec::new();
        }
        self.swept = Some(now);
        let mut out = Vec::new();
        self.conns.retain(|_, (c, used)| {
            let keep = now.saturating_duration_since(*used) < PEER_UNUSED;
            if !keep {
                out.push(c.clone());
            }
            keep
        });
        out
    }

    fn len(&self) -> usize {
        self.conns.len()
    }
}

/// A frame of `flags` around `payload`.
pub fn reframe_parts(flags: Flags, payload: &[u8]) -> Bytes {
    let header = FrameHeader {
        flags,
        length: payload.len() as u32,
    };
    let mut out = BytesMut::with_capacity(12 + payload.len());
    out.extend_from_slice(&header.to_bytes());
    out.extend_from_slice(payload);
    out.freeze()
}

/// Frames a raw JSON message.
pub fn json_frame(raw: &[u8]) -> Bytes {
    reframe_parts(Flags::JSON, raw)
}

/// The leader's refusal of the forwarded `auth`, as our own error.
fn remote_refusal(m: Message) -> BrokerError {
    match m {
        Message::Error { message, code, .. } => match code {
            Some(ErrorCode::Unauthenticated) => BrokerError::Unauthenticated(message),
            Some(ErrorCode::Forbidden) => BrokerError::Forbidden(message),
            _ => BrokerError::ShardUnavailable("owner_unavailable".into()),
        },
        _ => BrokerError::Internal("the shard leader answered auth with something else".into()),
    }
}

async fn read_frame(recv: &mut RecvStream, reader: &mut FrameReader) -> Option<Frame> {
    loop {
        if let Ok(Some(f)) = reader.next_frame() {
            return Some(f);
        }
        match recv.read_chunk(256 * 1024).await {
            Ok(Some(chunk)) => reader.push(chunk),
            _ => return None,
        }
    }
}

impl Forwarder {
    /// Binds this core's client endpoint (an ephemeral port: answers must come back to
    /// this core's socket, not the shared listening port).
    pub fn bind(config: [ClientConfig; 2], server_name: String) -> std::io::Result<Forwarder> {
        Ok(Forwarder {
            endpoint: Self::client_endpoint(false)?,
            endpoint_v6: RefCell::new(None),
            config,
            server_name,
            peers: RefCell::new(PeerTable::new()),
            sent: RefCell::default(),
            sent_waiters: RefCell::default(),
        })
    }

    /// A client endpoint on an ephemeral port of the unspecified address of either family.
    fn client_endpoint(v6: bool) -> std::io::Result<Endpoint> {
        let any = if v6 { "[::]:0" } else { "0.0.0.0:0" };
        Endpoint::bind(
            any.parse().expect("valid address"),
            EndpointOptions {
                server: None,
                crowded_server: None,
                max_connections: 1024,
                reuse_port: false,
                reset_secret: None,
                on_sent: None,
                windows: None,
            },
        )
    }

    /// The endpoint that reaches `addr`'s family, binding the IPv6 one at its first use.
    fn endpoint_for(&self, addr: SocketAddr) -> std::io::Result<Endpoint> {
        if addr.is_ipv4() {
            return Ok(self.endpoint.clone());
        }
        let mut v6 = self.endpoint_v6.borrow_mut();
        if let Some(e) = v6.as_ref() {
            return Ok(e.clone());
        }
        let e = Self::client_endpoint(true)?;
        *v6 = Some(e.clone());
        Ok(e)
    }

    async fn connection(&self, key: &PeerKey) -> Result<Connection, BrokerError> {
        let now = Instant::now();
        // Dropped, not closed: a request still running on one holds it open, and the
        // connection closes with its last handle.
        let unused = self.peers.borrow_mut().unused(now);
        drop(unused);
        let existing = self.peers.borrow_mut().get(key, now);
        if let Some(c) = existing {
            if c.close_reason().is_none() {
                return Ok(c);
            }
            self.peers.borrow_mut().remove(key);
        }
        let addr = key.0;
        let config = self.config[usize::from(key.2)].clone();
        let endpoint = self.endpoint_for(addr).map_err(|e| {
            tracing::warn!(%addr, error = %e, "binding a socket to reach the shard leader");
            BrokerError::ShardUnavailable("owner_unavailable".into())
        })?;
        let c = endpoint
            .connect(config, addr, &self.server_name)
            .await
            .map_err(|e| {
                tracing::warn!(%addr, error = %e, "connecting to the shard leader");
                BrokerError::ShardUnavailable("owner_unavailable".into())
            })?;
        let evicted = self
            .peers
            .borrow_mut()
            .insert(key.clone(), c.clone(), Instant::now());
        drop(evicted);
        Ok(c)
    }

    /// Waits until `bytes` more may be sent on the connection `key` (see [`SENT_MAX`]),
    /// behind every request for it that began waiting earlier; they count until the
    /// returned guard is dropped.
    async fn take_sent<'a>(&'a self, key: &PeerKey, bytes: usize) -> SentBytes<'a> {
        let ticket = self
            .sent
            .borrow_mut()
            .entry(key.clone())
            .or_insert_with(|| FifoBudget::new(SENT_MAX))
            .arrive();
        // Dropped unserved (the forward was cancelled), it gives its turn up.
        let mut waiting = Waiting {
            forwarder: self,
            key: key.clone(),
            ticket: Some(ticket),
        };
        std::future::poll_fn(|cx| {
            let taken = self
                .sent
                .borrow_mut()
                .get_mut(key)
                .is_some_and(|b| b.try_take(ticket, bytes));
            if taken {
                self.wake_sent();
                return std::task::Poll::Ready(());
            }
            self.sent_waiters.borrow_mut().push(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await;
        waiting.ticket = None;
        SentBytes {
            forwarder: self,
            key: key.clone(),
            bytes,
        }
    }

    /// Applies `f` to `key`'s budget, and lets the budget go once nothing holds or
    /// waits for it.
    fn with_sent(&self, key: &PeerKey, f: impl FnOnce(&mut FifoBudget)) {
        let mut sent = self.sent.borrow_mut();
        if let Some(b) = sent.get_mut(key) {
            f(b);
            if b.idle() {
                sent.remove(key);
            }
        }
    }

    fn wake_sent(&self) {
        std::mem::take(&mut *self.sent_waiters.borrow_mut())
            .into_iter()
            .for_each(std::task::Waker::wake);
    }

    /// Sends `auth` with `token` (which `grant` verified; offering `features` of the
    /// client's, see [`RELAYED_FEATURES`]) and `request` to the leader at `addr` on a
    /// fresh stream of the connection kept for the token's [`Holder`]. With
    /// `answered`, waits for and returns the answer frame; without, returns once sent.
    ///
    /// Failing before anything was sent is `shard_unavailable` (safe to retry); failing
    /// after is `unacknowledged` (the leader may have applied it).
    #[allow(clippy::too_many_arguments)]
    pub async fn call(
        &self,
        addr: SocketAddr,
        grant: &Grant,
        token: &str,
        features: Features,
        request: Bytes,
        answered: bool,
        again: bool,
    ) -> Result<Option<Frame>, BrokerError> {
        let key = (addr, Holder::of(grant), again);
        let conn = self.connection(&key).await?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|_| {
            self.peers.borrow_mut().remove(&key);
            BrokerError::ShardUnavailable("owner_unavailable".into())
        })?;
        let (lo, hi) = Features::ERROR_CODES
            .union(features.intersection(RELAYED_FEATURES))
            .offer();
        let auth = Message::Auth {
            tenant_id: grant.tenant.clone(),
            token: token.to_owned(),
            client_flags: Some(FORWARD_FLAGS.bits()),
            client_features: lo,
            client_features_hi: hi,
        }
        .to_frame();
        let lost =
            || BrokerError::Unacknowledged("the shard leader went away before answering".into());
        let sent = self.take_sent(&key, auth.len() + request.len()).await;
        send.write_chunks(&mut [auth, request])
            .await
            .map_err(|_| lost())?;
        let _ = send.finish();
        if !answered {
            return Ok(None);
        }
        let mut reader = FrameReader::preauth();
        let answer = task::timeout(ANSWER_TIMEOUT, async {
            let first = read_frame(&mut recv, &mut reader).await.ok_or_else(lost)?;
            match Message::decode(&first.payload) {
                Ok(Message::AuthOk { .. } | Message::Ok) => {}
                Ok(m) => return Err(remote_refusal(m)),
                Err(e) => return Err(BrokerError::Internal(format!("leader's auth answer: {e}"))),
            }
            reader.set_max_payload_bytes(felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES);
            read_frame(&mut recv, &mut reader).await.ok_or_else(lost)
        })
        .await
        .ok_or_else(|| {
            BrokerError::Unacknowledged("the shard leader did not answer in time".into())
        })??;
        drop(sent);
        Ok(Some(answer))
    }
}

/// Bytes a forward holds against its connection's [`SENT_MAX`] until dropped.
struct SentBytes<'a> {
    forwarder: &'a Forwarder,
    key: PeerKey,
    bytes: usize,
}

impl Drop for SentBytes<'_> {
    fn drop(&mut self) {
        let bytes = self.bytes;
        self.forwarder.with_sent(&self.key, |b| b.release(bytes));
        self.forwarder.wake_sent();
    }
}

/// A forward's place in line for [`SENT_MAX`], given up if it is dropped unserved.
struct Waiting<'a> {
    forwarder: &'a Forwarder,
    key: PeerKey,
    ticket: Option<u64>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket {
            self.forwarder.with_sent(&self.key, |b| b.leave(t));
            self.forwarder.wake_sent();
        }
    }
}

/// A byte budget handed out in arrival order: a large request waiting for room is not
/// passed by small ones that would fit (they would keep it waiting for ever). Sans-IO:
/// the caller waits and wakes.
#[derive(Debug)]
struct FifoBudget {
    budget: crate::session::outbox::ByteBudget,
    next: u64,
    /// The ticket whose turn it is.
    serving: u64,
    /// Tickets given up before their turn came.
    left: std::collections::BTreeSet<u64>,
}

impl FifoBudget {
    fn new(max: usize) -> FifoBudget {
        FifoBudget {
            budget: crate::session::outbox::ByteBudget::new(max),
            next: 0,
            serving: 0,
            left: Default::default(),
        }
    }

    /// A place in line.
    fn arrive(&mut self) -> u64 {
        self.next += 1;
        self.next - 1
    }

    /// Takes `bytes` for `ticket` if it is its turn and they fit (an empty budget admits
    /// anything); its turn then passes to the next.
    fn try_take(&mut self, ticket: u64, bytes: usize) -> bool {
        if ticket != self.serving || !self.budget.try_take(bytes) {
            return false;
        }
        self.advance();
        true
    }

    /// `ticket` gives its place up unserved.
    fn leave(&mut self, ticket: u64) {
        if ticket == self.serving {
            self.advance();
        } else {
            self.left.insert(ticket);
        }
    }

    fn release(&mut self, bytes: usize) {
        self.budget.release(bytes);
    }

    /// Nothing held, nobody in line: it may go (a new one is the same).
    fn idle(&self) -> bool {
        self.budget.used() == 0 && self.serving == self.next
    }

    fn advance(&mut self) {
        self.serving += 1;
        while self.left.remove(&self.serving) {
            self.serving += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forwarder trusting `certs`' authority, and a token holder to key peers by.
    fn forwarder_trusting(certs: &felix_core_runtime::quic::GeneratedCerts) -> (Forwarder, Holder) {
        let config = |again| {
            felix_core_runtime::quic::forwarding_client_config(
                std::slice::from_ref(&certs.ca_der),
                transport_limits(),
                again,
            )
            .unwrap()
        };
        let f = Forwarder::bind([config(false), config(true)], "localhost".into()).unwrap();
        let holder = Holder {
            tenant: "t".into(),
            kid: "k".into(),
            jti: None,
        };
        (f, holder)
    }

    /// Each connection to a leader has its own budget: a leader slow to answer (its
    /// connection's budget spent) holds up only the forwards to it.
    #[test]
    fn a_leader_slow_to_answer_holds_up_only_its_own_forwards() {
        task::block_on(async {
            let certs = felix_core_runtime::quic::generate_certs(&["localhost"]).unwrap();
            let (f, holder) = forwarder_trusting(&certs);
            let slow: PeerKey = (([127, 0, 0, 1], 7001).into(), holder.clone(), false);
            let healthy: PeerKey = (([127, 0, 0, 1], 7002).into(), holder, false);
            let spent = f.take_sent(&slow, SENT_MAX).await;
            // The healthy leader's forward goes at once.
            let other = task::timeout(Duration::from_secs(1), f.take_sent(&healthy, 1)).await;
            assert!(other.is_some(), "held up behind another leader's budget");
            drop(other);
            // One more to the slow one waits for its answers.
            let more = task::timeout(Duration::from_millis(50), f.take_sent(&slow, 1)).await;
            assert!(more.is_none(), "past its connection's budget");
            drop(spent);
            assert!(f.sent.borrow().is_empty(), "idle budgets are let go");
        });
    }

    /// A forwarder reaches a leader at an IPv6 address as well as one at an IPv4
    /// address (its first endpoint, bound to `0.0.0.0`, could not send to the first).
    #[test]
    fn a_leader_at_an_ipv6_address_is_reached_as_one_at_an_ipv4_address() {
        task::block_on(async {
            let certs = felix_core_runtime::quic::generate_certs(&["localhost"]).unwrap();
            let server = felix_core_runtime::quic::server_config(
                vec![certs.cert_der.clone()],
                certs.key(),
                transport_limits(),
            )
            .unwrap();
            let server = std::sync::Arc::new(server);
            let mut leaders = Vec::new();
            for at in ["127.0.0.1:0", "[::1]:0"] {
                let bound = Endpoint::bind(
                    at.parse().unwrap(),
                    EndpointOptions {
                        server: Some(server.clone()),
                        crowded_server: None,
                        max_connections: 8,
                        reuse_port: false,
                        reset_secret: None,
                        on_sent: None,
                        windows: None,
                    },
                );
                let ep = match bound {
                    Ok(ep) => ep,
                    // A host without IPv6 loopback cannot ask this.
                    Err(e) if at.starts_with('[') => {
                        eprintln!("no IPv6 loopback here ({e}): only IPv4 checked");
                        continue;
                    }
                    Err(e) => panic!("binding {at}: {e}"),
                };
                let accepting = ep.clone();
                let accepted = task::spawn(async move { accepting.accept().await.is_some() });
                leaders.push((ep, accepted));
            }
            let (f, holder) = forwarder_trusting(&certs);
            for (ep, accepted) in leaders {
                let addr = ep.local_addr();
                let key: PeerKey = (addr, holder.clone(), false);
                let c = task::timeout(Duration::from_secs(5), f.connection(&key))
                    .await
                    .unwrap_or_else(|| panic!("connecting to {addr} timed out"));
                assert!(c.is_ok(), "connecting to {addr}");
                assert!(accepted.await, "the leader at {addr} took the connection");
            }
        });
    }

    #[test]
    fn a_large_request_is_not_passed_by_small_ones_and_a_place_given_up_passes_on() {
        let mut b = FifoBudget::new(10);
        let first = b.arrive();
        assert!(b.try_take(first, 8));
        let large = b.arrive();
        let small = b.arrive();
        assert!(!b.try_take(large, 6), "2 bytes left");
        assert!(
            !b.try_take(small, 1),
            "it would fit, but the large one waits first"
        );
        b.release(8);
        assert!(b.try_take(large, 6));
        assert!(b.try_take(small, 1));
        // A waiter that goes away, before or at its turn, does not hold the line.
        let (gone, gone_too, next) = (b.arrive(), b.arrive(), b.arrive());
        b.leave(gone_too);
        b.leave(gone);
        assert!(b.try_take(next, 1));
        // An empty budget admits one request larger than all of it.
        b.release(8);
        let huge = b.arrive();
        assert!(b.try_take(huge, 100));
    }

    fn holder(tenant: &str, kid: &str, jti: Option<&str>) -> Holder {
        Holder {
            tenant: tenant.into(),
            kid: kid.into(),
            jti: jti.map(Into::into),
        }
    }

    /// Two grants share a connection exactly when a revocation hits both.
    #[test]
    fn grants_revoked_together_and_only_those_share_a_holder() {
        let mut one = crate::session::testing::grant(vec![]);
        one.jti = Some("t-1".into());
        let mut same =
            crate::session::testing::grant(vec!["stream.publish:stream:acme/x/y".into()]);
        same.jti = Some("t-1".into());
        same.principal = "another-app".into();
        same.expires_at += 3600;
        assert!(one.revoked_with(&same));
        assert_eq!(Holder::of(&one), Holder::of(&same));
        type Change = fn(&mut Grant);
        let changes: [(&str, Change); 4] = [
            ("another token id", |g| g.jti = Some("another".into())),
            ("no token id", |g| g.jti = None),
            ("another key", |g| g.kid = "another".into()),
            ("another tenant", |g| g.tenant = "another".into()),
        ];
        for (what, change) in changes {
            let mut other = one.clone();
            change(&mut other);
            assert!(!one.revoked_with(&other), "{what}");
            assert_ne!(Holder::of(&one), Holder::of(&other), "{what}");
        }
    }

    /// One connection per leader and revocable token identity: requests of another
    /// token (another id, another signing key, another tenant), or to another leader,
    /// never share it, since a leader closes a connection when one of its tokens is
    /// revoked; tokens revoked together do. A connection unused for a minute is let go,
    /// looked for at most every half minute.
    #[test]
    fn peers_are_kept_per_leader_and_token_and_unused_ones_are_let_go() {
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let t0 = Instant::now();
        let mut peers = PeerTable::new();
        assert!(peers.unused(t0).is_empty());
        let acme = holder("acme", "k1", Some("t1"));
        peers.insert((a, acme.clone(), false), 1, t0);
        for (other, what) in [
            (
                holder("acme", "k1", Some("t2")),
                "another token of the tenant",
            ),
            (holder("acme", "k1", None), "a token without an id"),
            (holder("acme", "k2", Some("t1")), "another key's token"),
            (holder("beta", "k1", Some("t1")), "another tenant's token"),
        ] {
            assert_eq!(
                peers.get(&(a, other, false), t0),
                None,
                "{what} does not share it"
            );
        }
        assert_eq!(
            peers.get(&(b, acme.clone(), false), t0),
            None,
            "nor another leader's"
        );
        let beta = holder("beta", "k1", Some("t1"));
        peers.insert((a, beta.clone(), false), 2, t0);
        peers.insert((b, acme.clone(), false), 3, t0);
        assert_eq!(peers.len(), 3);
        assert_eq!(
            peers.get(&(a, acme.clone(), false), t0 + Duration::from_secs(50)),
            Some(1)
        );
        // Past a minute, the two unused since t0 go; the one used at 50 s stays.
        let at = t0 + Duration::from_secs(70);
        let mut gone = peers.unused(at);
        gone.sort();
        assert_eq!(gone, vec![2, 3]);
        assert_eq!(peers.get(&(a, acme.clone(), false), at), Some(1));
        // Looked for again only half a minute later.
        assert!(peers.unused(at + Duration::from_secs(29)).is_empty());
        assert_eq!(peers.unused(at + Duration::from_secs(200)), vec![1]);
        peers.insert((a, acme.clone(), false), 4, at);
        peers.remove(&(a, acme.clone(), false));
        assert_eq!(peers.len(), 0);
    }

    /// However many tokens the clients present, a core keeps at most `PEERS_MAX`
    /// connections: the next one lets go of the one used longest ago, not of a busy one.
    #[test]
    fn a_core_keeps_at_most_peers_max_connections_and_lets_the_least_used_go() {
        let leader: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let token = |i: usize| (leader, holder("acme", "k1", Some(&format!("t{i}"))), false);
        let t0 = Instant::now();
        let mut peers = PeerTable::new();
        for i in 0..PEERS_MAX {
            let at = t0 + Duration::from_millis(i as u64);
            assert_eq!(peers.insert(token(i), i, at), None);
        }
        // The first is used again: the second is now the one used longest ago.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(peers.get(&token(0), later), Some(0));
        assert_eq!(peers.insert(token(PEERS_MAX), PEERS_MAX, later), Some(1));
        assert_eq!(peers.len(), PEERS_MAX);
        assert_eq!(peers.get(&token(1), later), None);
        assert_eq!(peers.get(&token(0), later), Some(0));
        // Replacing a kept one (its connection closed) lets nothing else go.
        assert_eq!(peers.insert(token(0), 1000, later), None);
        assert_eq!(peers.len(), PEERS_MAX);
    }
}
