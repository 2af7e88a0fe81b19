//! The QUIC endpoint driver: one quinn-proto `Endpoint` and its connections, driven by one
//! task on one core's executor.
//!
//! quinn-proto is sans-IO; this module moves bytes, timers and wakeups. Everything is
//! single-threaded: handles (`Connection`, `SendStream`, `RecvStream`) share the driver
//! state through `Rc<RefCell<_>>`, mutate the quinn-proto connection directly, mark it
//! dirty and wake the driver task, which then transmits. No borrow is ever held across an
//! `.await`.
//!
//! The driver loop, each iteration:
//! 1. send datagrams that found the socket full last time (awaiting room);
//! 2. drain the socket (non-blocking, bounded per iteration so one busy peer cannot
//!    starve timers) and feed every datagram to the endpoint — only after the readiness
//!    probe fired, so an iteration woken by a handle or a timer makes no receive call,
//!    or once [`READ_CHECK`] has passed since the last read (the probe can miss);
//! 3. fire expired connection timers;
//! 4. for every dirty connection: exchange endpoint events, turn application events into
//!    wakeups, and transmit until quinn has nothing more (bounded per connection);
//! 5. sleep until a datagram arrives, the earliest timer fires, or a handle wakes it, and
//!    no longer than the read check's interval past the last read ([`READ_CHECK`] while
//!    datagrams flow, longer on a quiet endpoint). The reactor timer is re-armed only
//!    for a sooner deadline (see `run`), so a busy endpoint, whose every read moves the
//!    check later, takes one early timer wake-up per check interval.
//!
//! Bounded memory against bad peers comes from quinn-proto's limits, which we set: at most
//! `max_connections` (more are refused in the handshake), 1024 concurrent streams per
//! direction, per-stream and per-connection receive windows, a send window, and an idle
//! timeout that also ends stalled handshakes.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, VecDeque};
use std::future::{Future, poll_fn};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use quinn_proto::{
    ClientConfig, ConnectionError, ConnectionHandle, DatagramEvent, Dir, EcnCodepoint,
    EndpointConfig, Event, ReadError, ReadableError, ServerConfig, StreamEvent, StreamId, VarInt,
    WriteError,
};
use rustc_hash::{FxHashMap, FxHashSet};

use super::udp::{Received, UdpIo};
use super::windows::{Credit, Grant, WindowPool};

/// Datagrams per GSO burst.
const MAX_GSO_SEGMENTS: usize = 16;
/// Receive buffer: one GRO run can be 64 KiB.
const RECV_BUFFER_BYTES: usize = 64 * 1024;
/// Receive calls per loop iteration before timers and transmits get a turn.
const RECV_BUDGET: usize = 64;
/// Transmits per connection per loop iteration.
const TRANSMIT_BUDGET: usize = 64;
/// Once this share of `max_connections` (a quarter) began its handshake within the
/// last `HANDSHAKE_DEADLINE`, a new connection from an address it has not shown to
/// receive our packets is first sent a Retry, which holds no state here: Initials from
/// forged addresses, each holding a slot until its deadline, filled the connection
/// table (some 900 a second at the default limit), and every real client on the core
/// was refused. A real client pays one round trip more, only then.
const RETRY_ABOVE_SHARE: usize = 4;
/// Connections not trusted yet (their receive window not widened since accept) that
/// may have the full untrusted window; the ones accepted past them, or past what the
/// window budget has spare, get the crowded server config's small one
/// (`EndpointOptions::crowded_server`).
pub const UNTRUSTED_FULL_WINDOWS: usize = 256;
/// Connections one source (an IPv4 address, an IPv6 /64) may have not trusted yet on a
/// core. Past it counting handshakes not finished, a new one from there whose address
/// is not validated is sent a Retry; past it counting only those whose address is
/// proven (validated by a Retry, or their handshake finished), one is refused: so
/// forged Initials cost a real host at that address a round trip, never its share, and
/// a burst of connects holds at most about twice this many. One host that completed
/// handshakes and never authenticated held up to the whole connection table until each
/// one's 10 s deadline, and every other client was refused. A real client is trusted
/// within a round trip of its handshake, so only a burst of this many connects from one
/// source at once meets the bound (clients behind one NAT address share it: past it
/// they are refused and connect again).
pub const UNTRUSTED_PER_SOURCE: usize = 256;

/// The source a connection from `addr` counts against: the IPv4 address (an
/// IPv4-mapped IPv6 one as IPv4), or the IPv6 /64, which one host may hold whole.
fn source_of(addr: SocketAddr) -> IpAddr {
    match addr.ip().to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
    }
}
/// How long an accepted connection may take to finish its handshake. Its idle timer
/// alone did not bound it: every packet of the peer's resets it, so a peer that kept
/// a handshake going and never finished it held its place (at the connection limit,
/// every new client was refused) for as long as it liked.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// The longest the loop trusts the readiness probe while datagrams flow: a loop that
/// runs this long after its last read reads anyway, and none sleeps past it. The probe
/// (a peek submitted to the executor's ring) was seen to stay pending for seconds with
/// datagrams waiting, while the loop ran on timers and sends: a long send to a slow
/// reader heard none of its acks and was closed by its own idle timer, the reader then
/// reset mid-stream. Each check of a parked core wakes it (~80 µs of CPU), so an
/// endpoint quiet for [`READ_CHECK_QUIET_AFTER`] checks less often: every
/// [`READ_CHECK_QUIET`] with connections open (20 checks a second cost an idle broker
/// with one connection 1.6 ms of CPU a second), every [`READ_CHECK_IDLE`] without.
pub const READ_CHECK: Duration = Duration::from_millis(50);
/// An endpoint with no datagram in or out for this long is quiet.
pub const READ_CHECK_QUIET_AFTER: Duration = Duration::from_millis(200);
/// [`READ_CHECK`] for a quiet endpoint with connections open: under the shortest idle
/// timeout whose keep-alives (a third of it apart) leave room for a quiet spell, so a
/// probe stuck then still lets the keep-alives in before the timeout.
pub const READ_CHECK_QUIET: Duration = Duration::from_millis(250);
/// [`READ_CHECK`] for a quiet endpoint with no connection: bounds what a stuck probe
/// delays a new handshake (a client resends its first packet after about a second).
pub const READ_CHECK_IDLE: Duration = Duration::from_secs(1);

/// When the loop reads its socket though the readiness probe has not fired (see
/// [`READ_CHECK`]). Time is passed in.
#[derive(Debug, Clone, Copy)]
struct ReadCheck {
    last_read: Instant,
    last_traffic: Instant,
    /// Datagrams received and sends made, as last seen.
    seen: (u64, u64),
}

impl ReadCheck {
    fn new(now: Instant) -> ReadCheck {
        ReadCheck {
            last_read: now,
            last_traffic: now,
            seen: (0, 0),
        }
    }

    fn interval(&self, now: Instant, has_connections: bool) -> Duration {
        if now.duration_since(self.last_traffic) < READ_CHECK_QUIET_AFTER {
            READ_CHECK
        } else if has_connections {
            READ_CHECK_QUIET
        } else {
            READ_CHECK_IDLE
        }
    }

    /// Whether a loop at `now` must read whatever the probe says.
    fn due(&self, now: Instant, has_connections: bool) -> bool {
        now.duration_since(self.last_read) >= self.interval(now, has_connections)
    }

    /// The socket was read at `now`.
    fn read(&mut self, now: Instant) {
        self.last_read = now;
    }

    /// The endpoint's counters after a loop at `now`: any change is traffic.
    fn counters(&mut self, now: Instant, datagrams_in: u64, sends: u64) {
        if (datagrams_in, sends) != self.seen {
            self.seen = (datagrams_in, sends);
            self.last_traffic = now;
        }
    }

    /// The latest a loop at `now` may sleep until.
    fn deadline(&self, now: Instant, has_connections: bool) -> Instant {
        self.last_read + self.interval(now, has_connections)
    }
}

/// [`EndpointStats::missed_wakeups`] over every endpoint of the process (a rare event,
/// so one shared counter costs nothing).
static MISSED_WAKEUPS: AtomicU64 = AtomicU64::new(0);

/// Reads forced by [`READ_CHECK`] that found datagrams waiting, every endpoint of the
/// process together.
pub fn missed_wakeups_total() -> u64 {
    MISSED_WAKEUPS.load(Ordering::Relaxed)
}

/// [`EndpointStats::send_errors`] over every endpoint of the process.
static SEND_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Datagrams the socket refused for good, every endpoint of the process together.
pub fn send_errors_total() -> u64 {
    SEND_ERRORS.load(Ordering::Relaxed)
}

/// Endpoint settings.
#[derive(Clone)]
pub struct EndpointOptions {
    /// Accept connections with this TLS/transport config (None: client only).
    pub server: Option<Arc<ServerConfig>>,
    /// Accept with this one instead while [`UNTRUSTED_FULL_WINDOWS`] connections are
    /// not trusted yet (see [`super::crowded_server_config`]).
    pub crowded_server: Option<Arc<ServerConfig>>,
    /// Connections beyond this are refused during the handshake.
    pub max_connections: usize,
    /// Bind with `SO_REUSEPORT` so every core can share the port.
    pub reuse_port: bool,
    /// The stateless-reset secret. A server that keeps it across restarts (and shares
    /// it between its cores) answers packets of connections it no longer knows with a
    /// reset its peers can verify, so they drop the connection at once instead of
    /// waiting out the idle timeout. `None`: a random one per endpoint.
    pub reset_secret: Option<[u8; 32]>,
    /// Called, on the endpoint's core, with how long stream data a connection was given
    /// waited for the first datagram that connection sent after it (measured from the
    /// oldest write not followed by a send yet): the last stage of an answer's way out.
    pub on_sent: Option<SentHook>,
    /// Draw every connection's flow-control windows from one budget (see
    /// [`super::windows`]); `None`: each has the transport's full windows.
    pub windows: Option<WindowBudget>,
}

/// The budget an endpoint's connections' flow-control windows are drawn from.
#[derive(Debug, Clone, Copy)]
pub struct WindowBudget {
    /// Bytes for all connections' windows together, both directions.
    pub bytes: u64,
    /// A connection's full window, each way: the transport's send and (once trusted)
    /// receive window.
    pub max_per_direction: u64,
}

/// See [`EndpointOptions::on_sent`].
pub type SentHook = Arc<dyn Fn(Duration) + Send + Sync>;

impl std::fmt::Debug for EndpointOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointOptions")
            .field("server", &self.server.is_some())
            .field("crowded_server", &self.crowded_server.is_some())
            .field("max_connections", &self.max_connections)
            .field("reuse_port", &self.reuse_port)
            .field("reset_secret", &self.reset_secret.is_some())
            .field("on_sent", &self.on_sent.is_some())
            .field("windows", &self.windows)
            .finish()
    }
}

/// Endpoint counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Datagrams received.
    pub datagrams_in: u64,
    /// Send calls (a GSO burst counts once).
    pub sends: u64,
    /// Connections accepted.
    pub accepted: u64,
    /// Connections refused (over the limit, or from a source past its share of
    /// connections not trusted yet: `UNTRUSTED_PER_SOURCE`).
    pub refused: u64,
    /// New connections sent a Retry first (many handshakes begun lately; see
    /// `RETRY_ABOVE_SHARE`).
    pub retried: u64,
    /// Connections open now.
    pub open: u64,
    /// Loop iterations.
    pub loops: u64,
    /// Loop iterations that took longer than 10 ms.
    pub stalls: u64,
    /// Reads forced by [`READ_CHECK`] that found datagrams the readiness probe had not
    /// reported.
    pub missed_wakeups: u64,
    /// Connections closed for not finishing their handshake in time.
    pub handshakes_timed_out: u64,
    /// Datagrams the socket refused for good (logged at the 1st, 2nd, 4th, 8th...).
    pub send_errors: u64,
}

/// Why a stream or connection operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuicError {
    /// The connection is gone.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The peer reset the stream.
    #[error("stream reset by peer with code {0}")]
    Reset(u64),
    /// The peer stopped reading the stream.
    #[error("stream stopped by peer with code {0}")]
    Stopped(u64),
    /// The stream was already finished or reset by us.
    #[error("stream already closed")]
    ClosedStream,
    /// The endpoint is shut down.
    #[error("endpoint closed")]
    EndpointClosed,
    /// Connecting failed before the handshake.
    #[error("connect failed: {0}")]
    Connect(String),
}

/// What the driver's bookkeeping needs from a datagram transport. The UDP socket
/// implements it; tests implement it in memory and step the driver with a virtual clock.
pub(crate) trait Datagrams {
    /// Where this transport receives.
    fn local_addr(&self) -> SocketAddr;
    /// The next datagram (or GRO run) without blocking.
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>>;
    /// Sends without blocking, with `ecn` in the IP header: the bytes taken, all of
    /// `data` unless the socket was full (0, or as many whole `segment`s of a burst as
    /// went out before it filled).
    fn try_send(
        &self,
        data: &[u8],
        dest: SocketAddr,
        segment: Option<usize>,
        ecn: Option<EcnCodepoint>,
    ) -> io::Result<usize>;
}

impl Datagrams for UdpIo {
    fn local_addr(&self) -> SocketAddr {
        UdpIo::local_addr(self)
    }

    fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
        UdpIo::try_recv(self, buf)
    }

    fn try_send(
        &self,
        data: &[u8],
        dest: SocketAddr,
        segment: Option<usize>,
        ecn: Option<EcnCodepoint>,
    ) -> io::Result<usize> {
        UdpIo::try_send(self, data, dest, segment, ecn)
    }
}

fn lost(e: &ConnectionError) -> QuicError {
    QuicError::ConnectionLost(e.to_string())
}

#[derive(Default)]
struct ConnState {
    handles: usize,
    connected: bool,
    lost: Option<ConnectionError>,
    incoming_bi: VecDeque<StreamId>,
    incoming_uni: VecDeque<StreamId>,
    accept_bi: Option<Waker>,
    accept_uni: Option<Waker>,
    readers: FxHashMap<StreamId, Waker>,
    writers: FxHashMap<StreamId, Waker>,
    open_waiters: Vec<Waker>,
    state_waiters: Vec<Waker>,
    timer: Option<Instant>,
    /// When stream data was first written since this connection last sent (only with
    /// an `on_sent` hook).
    unsent_since: Option<Instant>,
    /// Counted as not trusted yet until its window is widened or it goes.
    untrusted: Option<Untrusted>,
    /// Its windows, from the endpoint's pool (when it has one).
    grant: Option<Grant>,
    /// The receive window it was widened to (before its grant's cap); `None` while it
    /// keeps the window it began with.
    widened: Option<u32>,
}

/// A driver's connections not trusted yet, in all and by source: those whose address
/// is proven and those whose handshake has yet to show it.
#[derive(Default)]
struct UntrustedCount {
    all: Cell<usize>,
    by_source: RefCell<FxHashMap<IpAddr, (usize, usize)>>,
}

impl UntrustedCount {
    fn all(&self) -> usize {
        self.all.get()
    }

    /// `(proven, not yet)` from `source`.
    fn from(&self, source: IpAddr) -> (usize, usize) {
        self.by_source
            .borrow()
            .get(&source)
            .copied()
            .unwrap_or_default()
    }

    fn change(&self, source: IpAddr, f: impl FnOnce(&mut (usize, usize))) {
        let mut by_source = self.by_source.borrow_mut();
        let n = by_source.entry(source).or_default();
        f(n);
        if *n == (0, 0) {
            by_source.remove(&source);
        }
    }
}

/// A connection's place in its driver's count of connections not trusted yet, and in
/// its source's.
struct Untrusted {
    count: Rc<UntrustedCount>,
    source: IpAddr,
    proven: bool,
}

impl Untrusted {
    fn new(count: &Rc<UntrustedCount>, source: IpAddr, proven: bool) -> Untrusted {
        count.all.set(count.all.get() + 1);
        count.change(source, |n| {
            if proven {
                n.0 += 1;
            } else {
                n.1 += 1;
            }
        });
        Untrusted {
            count: count.clone(),
            source,
            proven,
        }
    }

    /// Its address is proven (its handshake finished).
    fn prove(&mut self) {
        if !self.proven {
            self.proven = true;
            self.count.change(self.source, |n| {
                n.1 -= 1;
                n.0 += 1;
            });
        }
    }
}

impl Drop for Untrusted {
    fn drop(&mut self) {
        self.count.all.set(self.count.all.get() - 1);
        let proven = self.proven;
        self.count.change(self.source, |n| {
            if proven {
                n.0 -= 1;
            } else {
                n.1 -= 1;
            }
        });
    }
}

struct Conn {
    q: quinn_proto::Connection,
    /// quinn-proto's handle, valid while `live` maps it to this connection.
    handle: ConnectionHandle,
    s: ConnState,
}

impl Conn {
    /// Sets its windows to what its grant allows: the send window always, the receive
    /// window once widened (before that it keeps the one it began with, bounded apart:
    /// see [`super::UNTRUSTED_WINDOW_BYTES`]; a client connection, which is not
    /// widened, keeps its transport's).
    fn apply_windows(&mut self) {
        let Some(g) = &self.s.grant else {
            if let Some(w) = self.s.widened {
                self.q.set_receive_window(VarInt::from_u32(w));
            }
            return;
        };
        self.q.set_send_window(g.each());
        if let Some(w) = self.s.widened {
            let w = g.receive_window(u64::from(w));
            self.q
                .set_receive_window(VarInt::from_u64(w).unwrap_or(VarInt::MAX));
        }
    }

    fn wake_all(&mut self) {
        for w in self
            .s
            .readers
            .drain()
            .map(|(_, w)| w)
            .chain(self.s.writers.drain().map(|(_, w)| w))
            .chain(self.s.open_waiters.drain(..))
            .chain(self.s.state_waiters.drain(..))
            .chain(self.s.accept_bi.take())
            .chain(self.s.accept_uni.take())
        {
            w.wake();
        }
    }
}

struct Driver {
    endpoint: quinn_proto::Endpoint,
    server: Option<Arc<ServerConfig>>,
    io: Rc<dyn Datagrams>,
    // Fx rather than SipHash: these are looked up per datagram and per stream call, and
    // their keys are our own handles or stream ids bounded by the stream limits.
    // Boxed: `drive` takes a connection out of the map and puts it back each time it
    // runs, and a quinn-proto connection is kilobytes; moving it twice per drive was an
    // inlined memcpy of 4.7% of a core in S8 (64 producers).
    conns: FxHashMap<ConnId, Box<Conn>>,
    /// quinn-proto's handle of each connection it still tracks. A handle is removed
    /// the moment quinn-proto frees it (the connection drained), because quinn-proto
    /// hands the same handle to its next connection.
    live: FxHashMap<ConnectionHandle, ConnId>,
    next_id: u64,
    dirty: FxHashSet<ConnId>,
    timers: BTreeSet<(Instant, ConnId)>,
    accept_queue: VecDeque<ConnId>,
    /// Accepted connections by when their handshake must be done, oldest first.
    handshakes: VecDeque<(Instant, ConnId)>,
    accept_waker: Option<Waker>,
    waker: Option<Waker>,
    woken: bool,
    closing: bool,
    max_connections: usize,
    /// Handshakes begun lately past which new connections are sent a Retry first.
    retry_above: usize,
    /// See [`EndpointOptions::crowded_server`].
    crowded_server: Option<Arc<ServerConfig>>,
    /// Connections accepted and not trusted yet, in all and by source address.
    untrusted: Rc<UntrustedCount>,
    /// How many of them may have the full untrusted window.
    untrusted_full: usize,
    /// How many of them one source address may have.
    untrusted_per_source: usize,
    blocked_sends: VecDeque<(Vec<u8>, SocketAddr, Option<usize>)>,
    send_buf: Vec<u8>,
    stats: EndpointStats,
    on_sent: Option<SentHook>,
    /// See [`EndpointOptions::windows`].
    windows: Option<Rc<WindowPool>>,
}

impl Driver {
    fn new(
        io: Rc<dyn Datagrams>,
        server: Option<Arc<ServerConfig>>,
        max_connections: usize,
        reset_secret: Option<[u8; 32]>,
    ) -> io::Result<Driver> {
        let mut endpoint_config = match reset_secret {
            Some(secret) => {
                let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
                // Connection ids must validate across restarts too (quinn-proto drops a
                // packet whose id its generator did not make, before any reset): the id
                // generator's key comes from the same secret.
                let tag = ring::hmac::sign(&key, b"felix quic connection id key");
                let cid_key = u64::from_le_bytes(tag.as_ref()[..8].try_into().expect("8 bytes"));
                let mut c = EndpointConfig::new(Arc::new(key));
                c.cid_generator(move || {
                    Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
                });
                c
            }
            None => EndpointConfig::default(),
        };
        endpoint_config
            .max_udp_payload_size(1472)
            .map_err(io::Error::other)?;
        let endpoint =
            quinn_proto::Endpoint::new(Arc::new(endpoint_config), server.clone(), true, None);
        Ok(Driver {
            endpoint,
            server,
            io,
            conns: FxHashMap::default(),
            live: FxHashMap::default(),
            next_id: 1,
            dirty: FxHashSet::default(),
            timers: BTreeSet::new(),
            accept_queue: VecDeque::new(),
            handshakes: VecDeque::new(),
            accept_waker: None,
            waker: None,
            woken: false,
            closing: false,
            max_connections,
            retry_above: max_connections.div_ceil(RETRY_ABOVE_SHARE),
            crowded_server: None,
            untrusted: Rc::default(),
            untrusted_full: UNTRUSTED_FULL_WINDOWS,
            untrusted_per_source: UNTRUSTED_PER_SOURCE,
            blocked_sends: VecDeque::new(),
            send_buf: Vec::with_capacity(MAX_GSO_SEGMENTS * 1500),
            stats: EndpointStats::default(),
            on_sent: None,
            windows: None,
        })
    }

    /// Draws connections' windows from `budget` from now on (after the crowded config,
    /// if any, is set: an endpoint without one must give every connection the full
    /// untrusted window, and keeps that back for each).
    fn set_windows(&mut self, budget: WindowBudget) {
        self.windows = Some(WindowPool::new(
            budget.bytes,
            budget.max_per_direction,
            self.crowded_server.is_some(),
            self.max_connections,
        ));
    }

    /// Starts a client handshake (the synchronous half of [`Endpoint::connect`]).
    fn start_connect(
        &mut self,
        now: Instant,
        config: ClientConfig,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<ConnId, QuicError> {
        if self.closing {
            return Err(QuicError::EndpointClosed);
        }
        let (h, q) = self
            .endpoint
            .connect(now, config, addr, server_name)
            .map_err(|e| QuicError::Connect(e.to_string()))?;
        let id = self.insert_conn(h, q, 1);
        self.mark(id);
        Ok(id)
    }

    /// See [`Connection::set_receive_window`].
    fn set_receive_window(&mut self, h: ConnId, bytes: u32) {
        if let Some(c) = self.conns.get_mut(&h) {
            c.s.widened = Some(bytes);
            c.apply_windows();
            // Trusted now: it no longer counts against the untrusted windows.
            c.s.untrusted = None;
        }
        self.mark(h);
    }

    /// See [`Connection::set_max_streams`].
    fn set_max_streams(&mut self, h: ConnId, bidi: u32, uni: u32) {
        if let Some(c) = self.conns.get_mut(&h) {
            c.q.set_max_concurrent_streams(Dir::Bi, VarInt::from_u32(bidi));
            c.q.set_max_concurrent_streams(Dir::Uni, VarInt::from_u32(uni));
        }
        self.mark(h);
    }

    /// Tracks a connection quinn-proto just created under a fresh id.
    fn insert_conn(
        &mut self,
        h: ConnectionHandle,
        q: quinn_proto::Connection,
        handles: usize,
    ) -> ConnId {
        let id = ConnId(self.next_id);
        self.next_id += 1;
        let replaced = self.live.insert(h, id);
        debug_assert!(
            replaced.is_none(),
            "quinn-proto reused a handle it had not freed"
        );
        self.conns.insert(
            id,
            Box::new(Conn {
                q,
                handle: h,
                s: ConnState {
                    handles,
                    ..ConnState::default()
                },
            }),
        );
        id
    }

    fn wake(&mut self) {
        self.woken = true;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    fn mark(&mut self, h: ConnId) {
        self.dirty.insert(h);
        self.wake();
    }

    fn send(
        &mut self,
        data_len: usize,
        dest: SocketAddr,
        segment: Option<usize>,
        ecn: Option<EcnCodepoint>,
    ) {
        self.stats.sends += 1;
        let data = &self.send_buf[..data_len];
        if !self.blocked_sends.is_empty() {
            self.blocked_sends.push_back((data.to_vec(), dest, segment));
            return;
        }
        match self.io.try_send(data, dest, segment, ecn) {
            Ok(n) if n >= data.len() => {}
            // The rest waits for room; what went out is not sent again.
            Ok(n) => self
                .blocked_sends
                .push_back((data[n..].to_vec(), dest, segment)),
            Err(e) => self.send_failed(dest, &e),
        }
    }

    /// Counts a datagram the socket refused, and logs it when the count reaches a power
    /// of two: Initials from a forged address the kernel will not send to (port 0) made
    /// one warning each.
    fn send_failed(&mut self, dest: SocketAddr, e: &io::Error) {
        self.stats.send_errors += 1;
        SEND_ERRORS.fetch_add(1, Ordering::Relaxed);
        let n = self.stats.send_errors;
        if n.is_power_of_two() {
            tracing::warn!(%dest, error = %e, failed = n, "udp send failed");
        }
    }

    fn handle_datagram(
        &mut self,
        now: Instant,
        from: SocketAddr,
        ecn: Option<EcnCodepoint>,
        data: BytesMut,
    ) {
        self.stats.datagrams_in += 1;
        let mut response = Vec::new();
        match self
            .endpoint
            .handle(now, from, None, ecn, data, &mut response)
        {
            None => {}
            Some(DatagramEvent::ConnectionEvent(h, event)) => {
                if let Some(&id) = self.live.get(&h)
                    && let Some(c) = self.conns.get_mut(&id)
                {
                    c.q.handle_event(event);
                    self.dirty.insert(id);
                }
            }
            Some(DatagramEvent::Response(t)) => {
                self.send_buf.clear();
                self.send_buf.extend_from_slice(&response[..t.size]);
                self.send(t.size, t.destination, t.segment_size, t.ecn);
            }
            Some(DatagramEvent::NewConnection(incoming)) => {
                let source = source_of(incoming.remote_address());
                // Refused past the share proven from there; sent a Retry first past it
                // counting handshakes not finished (forged Initials count only there, so
                // they cost a real host at that address a round trip, never its share).
                let (proven, unproven) = self.untrusted.from(source);
                let crowded_source = proven + unproven >= self.untrusted_per_source;
                let validated = incoming.remote_address_validated();
                if self.closing
                    || self.conns.len() >= self.max_connections
                    || self.server.is_none()
                    || (proven >= self.untrusted_per_source && (validated || !incoming.may_retry()))
                {
                    self.stats.refused += 1;
                    let t = self.endpoint.refuse(incoming, &mut response);
                    self.send_buf.clear();
                    self.send_buf.extend_from_slice(&response[..t.size]);
                    self.send(t.size, t.destination, t.segment_size, t.ecn);
                    return;
                }
                if incoming.may_retry()
                    && !validated
                    && (self.handshakes.len() >= self.retry_above || crowded_source)
                {
                    self.stats.retried += 1;
                    match self.endpoint.retry(incoming, &mut response) {
                        Ok(t) => {
                            self.send_buf.clear();
                            self.send_buf.extend_from_slice(&response[..t.size]);
                            self.send(t.size, t.destination, t.segment_size, t.ecn);
                        }
                        Err(e) => self.endpoint.ignore(e.into_incoming()),
                    }
                    return;
                }
                // The full untrusted window while few connections have it and the
                // window budget's spare covers it, else the crowded one. (Without a
                // budget it is always full; an endpoint with a budget and no crowded
                // config keeps the full window back for each connection, so always
                // full too.)
                let full = self.windows.as_ref().is_none_or(|p| p.may_begin_full());
                debug_assert!(full || self.crowded_server.is_some());
                let crowded = (self.untrusted.all() >= self.untrusted_full || !full)
                    .then(|| self.crowded_server.clone())
                    .flatten();
                let credit = if crowded.is_some() {
                    Credit::Crowded
                } else {
                    Credit::Full
                };
                match self.endpoint.accept(incoming, now, &mut response, crowded) {
                    Ok((h, q)) => {
                        let id = self.insert_conn(h, q, 0);
                        let grant = self.windows.as_ref().map(|p| p.admit(credit));
                        if let Some(c) = self.conns.get_mut(&id) {
                            c.s.untrusted =
                                Some(Untrusted::new(&self.untrusted, source, validated));
                            c.s.grant = grant;
                            c.apply_windows();
                        }
                        self.handshakes.push_back((now + HANDSHAKE_DEADLINE, id));
                        self.dirty.insert(id);
                    }
                    Err(e) => {
                        if let Some(t) = e.response {
                            self.send_buf.clear();
                            self.send_buf.extend_from_slice(&response[..t.size]);
                            self.send(t.size, t.destination, t.segment_size, t.ecn);
                        }
                    }
                }
            }
        }
    }

    /// Step 4 for one connection.
    fn drive(&mut self, h: ConnId, now: Instant) {
        let Some(mut c) = self.conns.remove(&h) else {
            return;
        };
        // Trusted and below its full windows, it takes its share of what is spare.
        if c.s.widened.is_some()
            && c.s.lost.is_none()
            && c.s.grant.as_mut().is_some_and(Grant::grow)
        {
            c.apply_windows();
        }
        while let Some(ev) = c.q.poll_endpoint_events() {
            let drained = ev.is_drained();
            if let Some(cev) = self.endpoint.handle_event(c.handle, ev) {
                c.q.handle_event(cev);
            }
            if drained {
                // quinn-proto has freed the handle and will give it to a new
                // connection: stop routing its datagrams here.
                self.live.remove(&c.handle);
            }
        }
        while let Some(ev) = c.q.poll() {
            match ev {
                Event::HandshakeDataReady => {}
                Event::Connected => {
                    c.s.connected = true;
                    // Its peer answered at its address: it counts against its source.
                    if let Some(u) = &mut c.s.untrusted {
                        u.prove();
                    }
                    if self.server.is_some() && c.s.handles == 0 && c.q.side().is_server() {
                        // Handed to accept(): the queue holds the first handle.
                        c.s.handles = 1;
                        self.accept_queue.push_back(h);
                        self.stats.accepted += 1;
                        if let Some(w) = self.accept_waker.take() {
                            w.wake();
                        }
                    }
                    for w in c.s.state_waiters.drain(..) {
                        w.wake();
                    }
                }
                Event::ConnectionLost { reason } => {
                    tracing::debug!(remote = %c.q.remote_address(), %reason, "quic connection lost");
                    c.s.lost = Some(reason);
                    // Over: it holds no window, nor its source's share, while it drains.
                    c.s.untrusted = None;
                    c.wake_all();
                }
                Event::Stream(StreamEvent::Opened { dir }) => {
                    while let Some(id) = c.q.streams().accept(dir) {
                        match dir {
                            Dir::Bi => c.s.incoming_bi.push_back(id),
                            Dir::Uni => c.s.incoming_uni.push_back(id),
                        }
                    }
                    let w = match dir {
                        Dir::Bi => c.s.accept_bi.take(),
                        Dir::Uni => c.s.accept_uni.take(),
                    };
                    if let Some(w) = w {
                        w.wake();
                    }
                }
                Event::Stream(StreamEvent::Readable { id }) => {
                    if let Some(w) = c.s.readers.remove(&id) {
                        w.wake();
                    }
                }
                Event::Stream(
                    StreamEvent::Writable { id }
                    | StreamEvent::Finished { id }
                    | StreamEvent::Stopped { id, .. },
                ) => {
                    if let Some(w) = c.s.writers.remove(&id) {
                        w.wake();
                    }
                }
                Event::Stream(StreamEvent::Available { .. }) => {
                    for w in c.s.open_waiters.drain(..) {
                        w.wake();
                    }
                }
                Event::DatagramReceived | Event::DatagramsUnblocked => {}
            }
        }
        let mut sent = false;
        let mut spent = true;
        for _ in 0..TRANSMIT_BUDGET {
            self.send_buf.clear();
            let Some(t) = c.q.poll_transmit(now, MAX_GSO_SEGMENTS, &mut self.send_buf) else {
                spent = false;
                break;
            };
            self.send(t.size, t.destination, t.segment_size, t.ecn);
            sent = true;
        }
        if spent {
            // Stopped by the budget, not for want of anything to send: driven again in
            // the next iteration (nothing else would bring it back before its next ACK
            // or timer).
            self.dirty.insert(h);
        }
        if sent && let (Some(hook), Some(written)) = (&self.on_sent, c.s.unsent_since.take()) {
            hook(Instant::now().saturating_duration_since(written));
        }
        let timeout = c.q.poll_timeout();
        if timeout != c.s.timer {
            if let Some(old) = c.s.timer {
                self.timers.remove(&(old, h));
            }
            if let Some(new) = timeout {
                self.timers.insert((new, h));
            }
            c.s.timer = timeout;
        }
        if c.q.is_drained() {
            if let Some(t) = c.s.timer.take() {
                self.timers.remove(&(t, h));
            }
            if c.s.lost.is_none() {
                c.s.lost = Some(ConnectionError::LocallyClosed);
            }
            c.wake_all();
            // Keep the state while handles remain, so they can report why.
            if c.s.handles > 0 {
                self.conns.insert(h, c);
            }
            return;
        }
        self.conns.insert(h, c);
    }
}

/// A QUIC endpoint on the current core. Dropping the last clone closes every connection.
#[derive(Clone)]
pub struct Endpoint {
    d: Rc<RefCell<Driver>>,
    task: Rc<RefCell<Option<glommio::Task<()>>>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("local_addr", &self.local_addr())
            .finish()
    }
}

impl Endpoint {
    /// Binds `addr` and starts the driver task on the current glommio executor.
    pub fn bind(addr: SocketAddr, options: EndpointOptions) -> io::Result<Endpoint> {
        let udp = Rc::new(UdpIo::bind(addr, options.reuse_port)?);
        let mut driver = Driver::new(
            udp.clone(),
            options.server,
            options.max_connections,
            options.reset_secret,
        )?;
        driver.on_sent = options.on_sent;
        driver.crowded_server = options.crowded_server;
        if let Some(w) = options.windows {
            driver.set_windows(w);
        }
        let d = Rc::new(RefCell::new(driver));
        let task = glommio::spawn_local(run(d.clone(), udp));
        Ok(Endpoint {
            d,
            task: Rc::new(RefCell::new(Some(task))),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.d.borrow().io.local_addr()
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        let d = self.d.borrow();
        EndpointStats {
            open: d.conns.len() as u64,
            ..d.stats
        }
    }

    /// The next established incoming connection; `None` once the endpoint is closed.
    pub async fn accept(&self) -> Option<Connection> {
        poll_fn(|cx| {
            let mut d = self.d.borrow_mut();
            if let Some(h) = d.accept_queue.pop_front() {
                return Poll::Ready(Some(Connection {
                    d: self.d.clone(),
                    h,
                }));
            }
            if d.closing {
                return Poll::Ready(None);
            }
            d.accept_waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Opens a connection and waits for its handshake.
    pub async fn connect(
        &self,
        config: ClientConfig,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<Connection, QuicError> {
        let h = self
            .d
            .borrow_mut()
            .start_connect(Instant::now(), config, addr, server_name)?;
        let conn = Connection {
            d: self.d.clone(),
            h,
        };
        poll_fn(|cx| {
            let mut d = self.d.borrow_mut();
            let Some(c) = d.conns.get_mut(&h) else {
                return Poll::Ready(Err(QuicError::ConnectionLost("drained".into())));
            };
            if let Some(e) = &c.s.lost {
                return Poll::Ready(Err(lost(e)));
            }
            if c.s.connected {
                return Poll::Ready(Ok(()));
            }
            c.s.state_waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await?;
        Ok(conn)
    }

    /// Closes every connection with `code` and stops accepting; `wait_idle` waits for
    /// the closes to be sent.
    pub fn close(&self, code: u32, reason: &[u8]) {
        let mut d = self.d.borrow_mut();
        d.closing = true;
        let now = Instant::now();
        let handles: Vec<ConnId> = d.conns.keys().copied().collect();
        for h in handles {
            if let Some(c) = d.conns.get_mut(&h) {
                c.q.close(now, VarInt::from_u32(code), Bytes::copy_from_slice(reason));
            }
            d.dirty.insert(h);
        }
        if let Some(w) = d.accept_waker.take() {
            w.wake();
        }
        d.wake();
    }

    /// Waits until every connection has drained (after `close`), then stops the driver.
    pub async fn wait_idle(&self) {
        loop {
            if self.d.borrow().conns.values().all(|c| c.q.is_drained()) {
                break;
            }
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
        let task = self.task.borrow_mut().take();
        self.d.borrow_mut().wake();
        if let Some(t) = task {
            t.await;
        }
    }
}

/// Our own name for a connection. Unlike quinn-proto's `ConnectionHandle` (a slab index
/// it frees when the connection drains and hands to the next one) it is never reused, so
/// a handle that outlives its connection finds it gone rather than finding a stranger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

/// A QUIC connection handle. Clones share the connection; it is closed when the last
/// handle (connection or stream) is dropped.
pub struct Connection {
    d: Rc<RefCell<Driver>>,
    h: ConnId,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("id", &self.h.0).finish()
    }
}

impl Clone for Connection {
    fn clone(&self) -> Self {
        retain(&self.d, self.h);
        Connection {
            d: self.d.clone(),
            h: self.h,
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        release(&self.d, self.h);
    }
}

fn retain(d: &Rc<RefCell<Driver>>, h: ConnId) {
    if let Some(c) = d.borrow_mut().conns.get_mut(&h) {
        c.s.handles += 1;
    }
}

fn release(d: &Rc<RefCell<Driver>>, h: ConnId) {
    let Ok(mut d) = d.try_borrow_mut() else {
        return;
    };
    let Some(c) = d.conns.get_mut(&h) else {
        return;
    };
    c.s.handles = c.s.handles.saturating_sub(1);
    if c.s.handles == 0 {
        if c.q.is_drained() {
            d.conns.remove(&h);
        } else {
            tracing::debug!(remote = %c.q.remote_address(), "closing a quic connection nothing holds");
            c.q.close(Instant::now(), VarInt::from_u32(0), Bytes::new());
            c.s.untrusted = None;
            d.mark(h);
        }
    }
}

impl Connection {
    /// This connection's id: unique for the endpoint's life, never reused.
    pub fn id(&self) -> ConnId {
        self.h
    }

    fn with<T>(&self, f: impl FnOnce(&mut Conn) -> T) -> Result<T, QuicError> {
        let mut d = self.d.borrow_mut();
        let c = d
            .conns
            .get_mut(&self.h)
            .ok_or_else(|| QuicError::ConnectionLost("drained".into()))?;
        Ok(f(c))
    }

    /// The peer's address.
    pub fn remote_address(&self) -> Option<SocketAddr> {
        self.with(|c| c.q.remote_address()).ok()
    }

    /// The negotiated ALPN protocol, if any.
    pub fn alpn(&self) -> Option<Vec<u8>> {
        self.with(|c| {
            c.q.crypto_session()
                .handshake_data()
                .and_then(|h| {
                    h.downcast::<quinn_proto::crypto::rustls::HandshakeData>()
                        .ok()
                })
                .and_then(|h| h.protocol)
        })
        .ok()
        .flatten()
    }

    /// Why the connection ended, if it has.
    pub fn close_reason(&self) -> Option<String> {
        self.with(|c| c.s.lost.as_ref().map(ToString::to_string))
            .unwrap_or_else(|e| Some(e.to_string()))
    }

    /// Sets how many bytes the peer may have in flight on all streams together: a
    /// server widens a connection it trusts from [`super::UNTRUSTED_WINDOW_BYTES`]. On an
    /// endpoint with a [`WindowBudget`] the window is the connection's grant, at most
    /// `bytes` and never below the credit it began with.
    pub fn set_receive_window(&self, bytes: u32) {
        self.d.borrow_mut().set_receive_window(self.h, bytes);
    }

    /// Sets how many streams the peer may have open at once, each way: a server raises
    /// them from [`super::UNTRUSTED_STREAMS`] once it trusts the connection.
    pub fn set_max_streams(&self, bidi: u32, uni: u32) {
        self.d.borrow_mut().set_max_streams(self.h, bidi, uni);
    }

    /// Closes the connection with an application error code.
    pub fn close(&self, code: u32, reason: &[u8]) {
        let mut d = self.d.borrow_mut();
        if let Some(c) = d.conns.get_mut(&self.h) {
            tracing::debug!(remote = %c.q.remote_address(), code, reason = %String::from_utf8_lossy(reason), "closing a quic connection");
            c.q.close(
                Instant::now(),
                VarInt::from_u32(code),
                Bytes::copy_from_slice(reason),
            );
            c.s.untrusted = None;
        }
        d.mark(self.h);
    }

    /// Waits until the connection ends; returns why.
    pub async fn closed(&self) -> String {
        poll_fn(|cx| {
            let mut d = self.d.borrow_mut();
            let Some(c) = d.conns.get_mut(&self.h) else {
                return Poll::Ready("drained".to_owned());
            };
            if let Some(e) = &c.s.lost {
                return Poll::Ready(e.to_string());
            }
            c.s.state_waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    fn stream_pair(&self, id: StreamId) -> (SendStream, RecvStream) {
        retain(&self.d, self.h);
        retain(&self.d, self.h);
        (
            SendStream {
                d: self.d.clone(),
                h: self.h,
                id,
                finished: false,
            },
            RecvStream {
                d: self.d.clone(),
                h: self.h,
                id,
                done: false,
            },
        )
    }

    fn send_only(&self, id: StreamId) -> SendStream {
        retain(&self.d, self.h);
        SendStream {
            d: self.d.clone(),
            h: self.h,
            id,
            finished: false,
        }
    }

    fn recv_only(&self, id: StreamId) -> RecvStream {
        retain(&self.d, self.h);
        RecvStream {
            d: self.d.clone(),
            h: self.h,
            id,
            done: false,
        }
    }

    async fn accept_dir(&self, dir: Dir) -> Result<StreamId, QuicError> {
        poll_fn(|cx| {
            let mut d = self.d.borrow_mut();
            let Some(c) = d.conns.get_mut(&self.h) else {
                return Poll::Ready(Err(QuicError::ConnectionLost("drained".into())));
            };
            let q = match dir {
                Dir::Bi => &mut c.s.incoming_bi,
                Dir::Uni => &mut c.s.incoming_uni,
            };
            if let Some(id) = q.pop_front() {
                return Poll::Ready(Ok(id));
            }
            if let Some(e) = &c.s.lost {
                return Poll::Ready(Err(lost(e)));
            }
            let slot = match dir {
                Dir::Bi => &mut c.s.accept_bi,
                Dir::Uni => &mut c.s.accept_uni,
            };
            *slot = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    async fn open_dir(&self, dir: Dir) -> Result<StreamId, QuicError> {
        poll_fn(|cx| {
            let mut d = self.d.borrow_mut();
            let Some(c) = d.conns.get_mut(&self.h) else {
                return Poll::Ready(Err(QuicError::ConnectionLost("drained".into())));
            };
            if let Some(e) = &c.s.lost {
                return Poll::Ready(Err(lost(e)));
            }
            if let Some(id) = c.q.streams().open(dir) {
                d.mark(self.h);
                return Poll::Ready(Ok(id));
            }
            c.s.open_waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Waits for the peer to open a bidirectional stream.
    pub async fn accept_bi(&self) -> Result<(SendStream, RecvStream), QuicError> {
        let id = self.accept_dir(Dir::Bi).await?;
        Ok(self.stream_pair(id))
    }

    /// Waits for the peer to open a unidirectional stream.
    pub async fn accept_uni(&self) -> Result<RecvStream, QuicError> {
        let id = self.accept_dir(Dir::Uni).await?;
        Ok(self.recv_only(id))
    }

    /// Opens a bidirectional stream, waiting for stream credit if needed.
    pub async fn open_bi(&self) -> Result<(SendStream, RecvStream), QuicError> {
        let id = self.open_dir(Dir::Bi).await?;
        Ok(self.stream_pair(id))
    }

    /// Opens a unidirectional stream, waiting for stream credit if needed.
    pub async fn open_uni(&self) -> Result<SendStream, QuicError> {
        let id = self.open_dir(Dir::Uni).await?;
        Ok(self.send_only(id))
    }
}

/// The sending half of a stream. Dropping it finishes the stream.
pub struct SendStream {
    d: Rc<RefCell<Driver>>,
    h: ConnId,
    id: StreamId,
    finished: bool,
}

impl std::fmt::Debug for SendStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendStream").field("id", &self.id).finish()
    }
}

impl SendStream {
    fn poll_op<T>(
        &mut self,
        cx: &mut Context<'_>,
        op: &mut dyn FnMut(&mut quinn_proto::SendStream<'_>) -> Result<T, WriteError>,
    ) -> Poll<Result<T, QuicError>> {
        let mut d = self.d.borrow_mut();
        let timed = d.on_sent.is_some();
        let Some(c) = d.conns.get_mut(&self.h) else {
            return Poll::Ready(Err(QuicError::ConnectionLost("drained".into())));
        };
        if let Some(e) = &c.s.lost {
            return Poll::Ready(Err(lost(e)));
        }
        let result = op(&mut c.q.send_stream(self.id));
        match result {
            Ok(v) => {
                if timed && c.s.unsent_since.is_none() {
                    c.s.unsent_since = Some(Instant::now());
                }
                d.mark(self.h);
                Poll::Ready(Ok(v))
            }
            Err(WriteError::Blocked) => {
                c.s.writers.insert(self.id, cx.waker().clone());
                Poll::Pending
            }
            Err(WriteError::Stopped(code)) => {
                Poll::Ready(Err(QuicError::Stopped(code.into_inner())))
            }
            Err(WriteError::ClosedStream) => Poll::Ready(Err(QuicError::ClosedStream)),
        }
    }

    /// Writes some of `data`, waiting for flow-control credit; returns how much.
    pub async fn write(&mut self, data: &[u8]) -> Result<usize, QuicError> {
        poll_fn(|cx| self.poll_op(cx, &mut |s| s.write(data))).await
    }

    /// Writes all of `data`.
    pub async fn write_all(&mut self, mut data: &[u8]) -> Result<(), QuicError> {
        while !data.is_empty() {
            let n = self.write(data).await?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Writes a shared buffer without copying it.
    pub async fn write_chunk(&mut self, chunk: Bytes) -> Result<(), QuicError> {
        let mut bufs = [chunk];
        while !bufs[0].is_empty() {
            poll_fn(|cx| self.poll_op(cx, &mut |s| s.write_chunks(&mut bufs).map(|_| ()))).await?;
        }
        Ok(())
    }

    /// Writes several shared buffers without copying them, in order, in one pass.
    pub async fn write_chunks(&mut self, chunks: &mut [Bytes]) -> Result<(), QuicError> {
        let mut at = 0;
        while at < chunks.len() {
            let rest = &mut chunks[at..];
            let written = poll_fn(|cx| self.poll_op(cx, &mut |s| s.write_chunks(rest))).await?;
            at += written.chunks;
            // A partly written chunk stays at the front, its written part sliced off.
            while at < chunks.len() && chunks[at].is_empty() {
                at += 1;
            }
        }
        Ok(())
    }

    /// Finishes the stream (no more data).
    pub fn finish(&mut self) -> Result<(), QuicError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        let mut d = self.d.borrow_mut();
        let Some(c) = d.conns.get_mut(&self.h) else {
            return Err(QuicError::ConnectionLost("drained".into()));
        };
        let r = finish_or_reset(&mut c.q, self.id);
        d.mark(self.h);
        r
    }

    /// Abandons the stream with an error code.
    pub fn reset(&mut self, code: u32) {
        self.finished = true;
        let mut d = self.d.borrow_mut();
        if let Some(c) = d.conns.get_mut(&self.h) {
            let _ = c.q.send_stream(self.id).reset(VarInt::from_u32(code));
            d.mark(self.h);
        }
    }

    /// Bytes the peer has not yet acknowledged... not tracked; streams expose only
    /// whether the peer stopped reading.
    pub fn stopped(&self) -> Option<u64> {
        let mut d = self.d.borrow_mut();
        let c = d.conns.get_mut(&self.h)?;
        c.q.send_stream(self.id)
            .stopped()
            .ok()
            .flatten()
            .map(VarInt::into_inner)
    }
}

impl Drop for SendStream {
    fn drop(&mut self) {
        if !self.finished
            && let Ok(mut d) = self.d.try_borrow_mut()
            && let Some(c) = d.conns.get_mut(&self.h)
        {
            let _ = finish_or_reset(&mut c.q, self.id);
            d.mark(self.h);
        }
        release(&self.d, self.h);
    }
}

/// Finishes a send stream, or resets it when the peer stopped it. quinn-proto frees a
/// stream the peer stopped only once it is reset (the reset acknowledged): finishing it
/// fails and leaves it allocated, and with it one of the peer's stream credits. A client
/// that stops reading each answer before the answer's stream is finished (our SDK's
/// one-request streams do) then found, after `max_streams` requests, that it could open
/// no more on that connection.
fn finish_or_reset(q: &mut quinn_proto::Connection, id: StreamId) -> Result<(), QuicError> {
    let mut s = q.send_stream(id);
    match s.finish() {
        Ok(()) => Ok(()),
        Err(quinn_proto::FinishError::Stopped(code)) => {
            let _ = s.reset(code);
            Err(QuicError::Stopped(code.into_inner()))
        }
        Err(quinn_proto::FinishError::ClosedStream) => Err(QuicError::ClosedStream),
    }
}

/// The receiving half of a stream. Dropping it before the end stops the stream.
pub struct RecvStream {
    d: Rc<RefCell<Driver>>,
    h: ConnId,
    id: StreamId,
    done: bool,
}

impl std::fmt::Debug for RecvStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvStream").field("id", &self.id).finish()
    }
}

impl RecvStream {
    /// The next chunk of at most `max` bytes, in order; `Ok(None)` at the end of the
    /// stream. Chunks are shared buffers, not copies.
    pub async fn read_chunk(&mut self, max: usize) -> Result<Option<Bytes>, QuicError> {
        poll_fn(|cx| self.poll_read_chunk(cx, max)).await
    }

    /// Polls for the next chunk.
    pub fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Result<Option<Bytes>, QuicError>> {
        let mut d = self.d.borrow_mut();
        let Some(c) = d.conns.get_mut(&self.h) else {
            return Poll::Ready(Err(QuicError::ConnectionLost("drained".into())));
        };
        let mut stream = c.q.recv_stream(self.id);
        let mut chunks = match stream.read(true) {
            Ok(chunks) => chunks,
            Err(ReadableError::ClosedStream) => {
                self.done = true;
                return Poll::Ready(Ok(None));
            }
            Err(ReadableError::IllegalOrderedRead) => {
                return Poll::Ready(Err(QuicError::ClosedStream));
            }
        };
        let result = chunks.next(max);
        let transmit = chunks.finalize().should_transmit();
        let out = match result {
            Ok(Some(chunk)) => Poll::Ready(Ok(Some(chunk.bytes))),
            Ok(None) => {
                self.done = true;
                Poll::Ready(Ok(None))
            }
            Err(ReadError::Blocked) => {
                if let Some(e) = &c.s.lost {
                    Poll::Ready(Err(lost(e)))
                } else {
                    c.s.readers.insert(self.id, cx.waker().clone());
                    Poll::Pending
                }
            }
            Err(ReadError::Reset(code)) => {
                self.done = true;
                Poll::Ready(Err(QuicError::Reset(code.into_inner())))
            }
        };
        if transmit {
            d.mark(self.h);
        }
        out
    }

    /// Reads exactly `buf.len()` bytes; `Ok(false)` if the stream ended first (at a
    /// clean boundary: nothing read) and an error if it ended mid-way.
    pub async fn read_exact(&mut self, buf: &mut [u8]) -> Result<bool, QuicError> {
        let mut at = 0;
        while at < buf.len() {
            match self.read_chunk(buf.len() - at).await? {
                Some(chunk) => {
                    buf[at..at + chunk.len()].copy_from_slice(&chunk);
                    at += chunk.len();
                }
                None if at == 0 => return Ok(false),
                None => return Err(QuicError::ClosedStream),
            }
        }
        Ok(true)
    }

    /// Tells the peer to stop sending.
    pub fn stop(&mut self, code: u32) {
        self.done = true;
        let mut d = self.d.borrow_mut();
        if let Some(c) = d.conns.get_mut(&self.h) {
            let _ = c.q.recv_stream(self.id).stop(VarInt::from_u32(code));
            d.mark(self.h);
        }
    }
}

impl Drop for RecvStream {
    fn drop(&mut self) {
        if !self.done
            && let Ok(mut d) = self.d.try_borrow_mut()
            && let Some(c) = d.conns.get_mut(&self.h)
        {
            let _ = c.q.recv_stream(self.id).stop(VarInt::from_u32(0));
            d.mark(self.h);
        }
        release(&self.d, self.h);
    }
}

/// Steps 2 to 4 of the loop. The socket is read only while `readable` says it may hold
/// datagrams; it is cleared once a read finds it empty. Returns whether to loop again at
/// once and the next timer, or `None` when the endpoint is closed and drained.
fn process(
    dr: &mut Driver,
    io: &dyn Datagrams,
    recv_buf: &mut [u8],
    readable: &mut bool,
    now: Instant,
    last: &mut Instant,
) -> Option<(bool, Option<Instant>)> {
    dr.stats.loops += 1;
    if now.duration_since(*last) > Duration::from_millis(10) {
        dr.stats.stalls += 1;
    }
    *last = now;
    // 2. Drain the socket.
    for _ in 0..RECV_BUDGET {
        if !*readable {
            break;
        }
        match io.try_recv(recv_buf) {
            Ok(Some(r)) => {
                let seg = r.segment.unwrap_or(r.len).max(1);
                // One allocation per datagram, on purpose: quinn-proto's stream reassembly
                // charges each buffered chunk its packet's size, so a datagram cut out of a
                // shared receive buffer would pin the whole buffer behind a chunk a peer
                // leaves unread (tried: no CPU measurably saved, see docs/benchmarks.md).
                for piece in recv_buf[..r.len].chunks(seg) {
                    dr.handle_datagram(now, r.from, r.ecn, BytesMut::from(piece));
                }
            }
            Ok(None) => *readable = false,
            Err(e) => {
                tracing::warn!(error = %e, "udp receive failed");
                *readable = false;
            }
        }
    }
    // 3. Expired timers.
    while let Some(&(at, h)) = dr.timers.first() {
        if at > now {
            break;
        }
        dr.timers.remove(&(at, h));
        if let Some(c) = dr.conns.get_mut(&h) {
            c.s.timer = None;
            c.q.handle_timeout(now);
            dr.dirty.insert(h);
        }
    }
    // Handshakes past their deadline are closed.
    while let Some(&(at, h)) = dr.handshakes.front() {
        if at > now {
            break;
        }
        dr.handshakes.pop_front();
        if let Some(c) = dr.conns.get_mut(&h)
            && !c.s.connected
            && !c.q.is_closed()
        {
            dr.stats.handshakes_timed_out += 1;
            c.s.untrusted = None;
            c.q.close(
                now,
                VarInt::from_u32(0),
                Bytes::from_static(b"handshake too slow"),
            );
            dr.dirty.insert(h);
        }
    }
    // 4. Dirty connections.
    let dirty: Vec<_> = dr.dirty.drain().collect();
    for h in dirty {
        dr.drive(h, now);
    }
    if dr.closing && dr.accept_queue.is_empty() && dr.conns.values().all(|c| c.q.is_drained()) {
        return None;
    }
    let again = !dr.dirty.is_empty() || !dr.blocked_sends.is_empty() || *readable;
    dr.woken = false;
    let next = dr.timers.first().map(|(at, _)| *at);
    let deadline = dr.handshakes.front().map(|(at, _)| *at);
    Some((again, next.into_iter().chain(deadline).min()))
}

/// The driver task: see the module docs for the loop.
async fn run(d: Rc<RefCell<Driver>>, io: Rc<UdpIo>) {
    let mut readable: Pin<Box<dyn Future<Output = io::Result<()>>>> = Box::pin(io.readable());
    let mut timer: Option<(Instant, glommio::timer::Timer)> = None;
    let mut recv_buf = vec![0u8; RECV_BUFFER_BYTES];
    let mut last = Instant::now();
    // Whether the socket may hold datagrams: set when the readiness probe fires, cleared
    // when a read comes back empty, so a loop woken by a task or a timer makes no
    // receive syscall that is bound to fail.
    let mut socket_ready = true;
    let mut check = ReadCheck::new(Instant::now());
    loop {
        // 1. Datagrams that found the socket full.
        loop {
            let next = d.borrow_mut().blocked_sends.pop_front();
            let Some((data, dest, segment)) = next else {
                break;
            };
            if let Err(e) = io.send_waiting(&data, dest, segment).await {
                d.borrow_mut().send_failed(dest, &e);
            }
        }
        let now = Instant::now();
        // Trust the readiness probe only so long (see READ_CHECK).
        let (before, had_connections) = {
            let dr = d.borrow();
            (dr.stats.datagrams_in, !dr.conns.is_empty())
        };
        let forced = !socket_ready && check.due(now, had_connections);
        if forced || socket_ready {
            socket_ready = true;
            check.read(now);
        }
        let Some((again, deadline)) = process(
            &mut d.borrow_mut(),
            io.as_ref(),
            &mut recv_buf,
            &mut socket_ready,
            now,
            &mut last,
        ) else {
            return;
        };
        if forced {
            // Datagrams found though the probe, asked once more, is still pending: it
            // missed them (a probe that fired but was not looked at yet is no miss).
            let pending = futures_lite::future::poll_once(readable.as_mut())
                .await
                .is_none();
            let mut dr = d.borrow_mut();
            if pending && dr.stats.datagrams_in > before {
                dr.stats.missed_wakeups += 1;
                MISSED_WAKEUPS.fetch_add(1, Ordering::Relaxed);
            }
            // A fresh probe in place of one pending this long: glommio keeps a waker
            // clone for every poll of a pending read, so a probe polled by every loop
            // for hours would hold hours of them.
            readable = Box::pin(io.readable());
        }
        let deadline = {
            let dr = d.borrow();
            check.counters(now, dr.stats.datagrams_in, dr.stats.sends);
            let cap = check.deadline(now, !dr.conns.is_empty());
            deadline.map_or(cap, |at| at.min(cap))
        };
        if again {
            futures_lite::future::yield_now().await;
            continue;
        }
        // 5. Sleep until something happens. The timer is re-armed only when the next
        // deadline comes sooner than the armed one: quinn-proto pushes its idle timeout
        // later on every packet, and re-arming each time costs the reactor a timeout
        // submission and a cancellation per loop. One that fires early finds nothing
        // expired and is armed again for the real deadline.
        if timer.as_ref().is_none_or(|(at, _)| *at > deadline) {
            let wait = deadline.saturating_duration_since(Instant::now());
            timer = Some((deadline, glommio::timer::Timer::new(wait)));
        }
        poll_fn(|cx| {
            let mut dr = d.borrow_mut();
            // The probe first: a probe is submitted only when first polled, and a loop
            // woken by its handles again and again would otherwise never look at it.
            if readable.as_mut().poll(cx).is_ready() {
                readable = Box::pin(io.readable());
                socket_ready = true;
                dr.woken = false;
                return Poll::Ready(());
            }
            if dr.woken {
                dr.woken = false;
                return Poll::Ready(());
            }
            if let Some((_, t)) = timer.as_mut()
                && Pin::new(t).poll(cx).is_ready()
            {
                timer = None;
                return Poll::Ready(());
            }
            dr.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
    }
}

#[cfg(test)]
mod read_check {
    use std::time::{Duration, Instant};

    use super::{READ_CHECK, READ_CHECK_IDLE, READ_CHECK_QUIET, READ_CHECK_QUIET_AFTER, ReadCheck};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_loop_reads_once_the_check_interval_passed_since_its_last_read() {
        let t0 = Instant::now();
        let mut c = ReadCheck::new(t0);
        c.counters(t0, 1, 1);
        assert!(!c.due(t0 + READ_CHECK - MS, true));
        assert!(c.due(t0 + READ_CHECK, true));
        c.read(t0 + READ_CHECK);
        assert!(
            !c.due(t0 + READ_CHECK + MS, true),
            "a read starts the interval again"
        );
    }

    #[test]
    fn a_quiet_endpoint_checks_less_often_and_one_without_connections_least() {
        let t0 = Instant::now();
        let mut c = ReadCheck::new(t0);
        c.counters(t0, 5, 5);
        let quiet = t0 + READ_CHECK_QUIET_AFTER;
        assert!(
            !c.due(quiet, true),
            "quiet: {READ_CHECK_QUIET:?} from the last read"
        );
        assert!(c.due(t0 + READ_CHECK_QUIET, true));
        assert!(!c.due(t0 + READ_CHECK_QUIET, false));
        assert!(c.due(t0 + READ_CHECK_IDLE, false));
        // Unchanged counters are no traffic; a change is.
        c.counters(quiet, 5, 5);
        assert!(!c.due(t0 + READ_CHECK_QUIET - MS, true));
        c.counters(quiet, 6, 5);
        assert!(c.due(quiet, true), "traffic again: {READ_CHECK:?}");
    }

    #[test]
    fn the_deadline_is_never_behind_a_loop_that_did_not_have_to_read() {
        let t0 = Instant::now();
        let mut c = ReadCheck::new(t0);
        for step in 0..2_000u64 {
            let now = t0 + Duration::from_micros(step * 997);
            let conns = step % 3 != 0;
            if step % 7 == 0 {
                c.counters(now, step, step);
            }
            if c.due(now, conns) {
                c.read(now);
            }
            assert!(c.deadline(now, conns) > now, "step {step}");
            assert!(c.deadline(now, conns) <= now + READ_CHECK_IDLE);
        }
    }
}

/// The driver's bookkeeping without sockets or an executor: drivers exchange datagrams
/// through an in-memory network and are stepped with a virtual clock, so timeouts of
/// seconds take microseconds and every run is the same.
#[cfg(test)]
mod sans_io {
    use std::cell::{Cell, RefCell};
    use std::collections::{HashSet, VecDeque};
    use std::io;
    use std::net::SocketAddr;
    use std::rc::Rc;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{Datagrams, Driver, process};
    use crate::quic::udp::Received;
    use crate::quic::{TransportLimits, client_config, generate_certs, server_config};

    /// Datagrams in flight, destinations whose traffic is lost, and destinations whose
    /// next datagram is.
    #[derive(Default)]
    struct Net {
        queue: RefCell<VecDeque<(SocketAddr, SocketAddr, Vec<u8>)>>,
        black_holes: RefCell<HashSet<SocketAddr>>,
        lose_next: RefCell<HashSet<SocketAddr>>,
        /// Destinations the socket refuses to send to (as the kernel refuses port 0).
        refused: RefCell<HashSet<SocketAddr>>,
        /// Datagrams the socket takes before it is full (`None`: no limit).
        room: Cell<Option<usize>>,
    }

    struct MemIo {
        addr: SocketAddr,
        net: Rc<Net>,
    }

    impl Datagrams for MemIo {
        fn local_addr(&self) -> SocketAddr {
            self.addr
        }

        fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
            let mut q = self.net.queue.borrow_mut();
            let Some(i) = q.iter().position(|(_, to, _)| *to == self.addr) else {
                return Ok(None);
            };
            let (from, _, data) = q.remove(i).expect("found");
            buf[..data.len()].copy_from_slice(&data);
            Ok(Some(Received {
                len: data.len(),
                from,
                segment: None,
                ecn: None,
            }))
        }

        fn try_send(
            &self,
            data: &[u8],
            dest: SocketAddr,
            segment: Option<usize>,
            _ecn: Option<quinn_proto::EcnCodepoint>,
        ) -> io::Result<usize> {
            if self.net.black_holes.borrow().contains(&dest) {
                return Ok(data.len());
            }
            if self.net.refused.borrow().contains(&dest) {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            let step = segment.unwrap_or(data.len()).max(1);
            let mut sent = 0;
            for piece in data.chunks(step) {
                if let Some(room) = self.net.room.get() {
                    if room == 0 {
                        return Ok(sent);
                    }
                    self.net.room.set(Some(room - 1));
                }
                sent += piece.len();
                if self.net.lose_next.borrow_mut().remove(&dest) {
                    continue;
                }
                self.net
                    .queue
                    .borrow_mut()
                    .push_back((self.addr, dest, piece.to_vec()));
            }
            Ok(sent)
        }
    }

    struct Fixture {
        net: Rc<Net>,
        server: Driver,
        server_addr: SocketAddr,
        client_config: quinn_proto::ClientConfig,
        now: Instant,
    }

    fn addr(port: u16) -> SocketAddr {
        ([127, 0, 0, 1], port).into()
    }

    fn fixture(max_connections: usize, limits: TransportLimits) -> Fixture {
        let certs = generate_certs(&["localhost"]).unwrap();
        let server_cfg =
            Arc::new(server_config(vec![certs.cert_der.clone()], certs.key(), limits).unwrap());
        let net = Rc::new(Net::default());
        let server_addr = addr(4433);
        let io = Rc::new(MemIo {
            addr: server_addr,
            net: net.clone(),
        });
        Fixture {
            server: Driver::new(io, Some(server_cfg), max_connections, None).unwrap(),
            server_addr,
            client_config: client_config(std::slice::from_ref(&certs.ca_der), false, limits)
                .unwrap(),
            net,
            now: Instant::now(),
        }
    }

    fn client(f: &Fixture, port: u16) -> Driver {
        client_at(f, addr(port))
    }

    fn client_at(f: &Fixture, at: SocketAddr) -> Driver {
        Driver::new(
            Rc::new(MemIo {
                addr: at,
                net: f.net.clone(),
            }),
            None,
            16,
            None,
        )
        .unwrap()
    }

    fn step(d: &mut Driver, now: Instant) {
        let io = d.io.clone();
        let mut buf = vec![0u8; 65536];
        let mut last = now;
        process(d, io.as_ref(), &mut buf, &mut true, now, &mut last);
    }

    /// Steps the server and every client `n` times, `dt` of virtual time apart.
    fn run(f: &mut Fixture, clients: &mut [Driver], n: usize, dt: Duration) {
        for _ in 0..n {
            for c in clients.iter_mut() {
                step(c, f.now);
            }
            step(&mut f.server, f.now);
            f.now += dt;
        }
    }

    fn connected(d: &Driver) -> usize {
        d.conns.values().filter(|c| c.s.connected).count()
    }

    #[test]
    fn a_handshake_completes_over_a_virtual_network() {
        let mut f = fixture(16, TransportLimits::default());
        let mut c = client(&f, 5000);
        let cfg = f.client_config.clone();
        c.start_connect(f.now, cfg, f.server_addr, "localhost")
            .unwrap();
        run(
            &mut f,
            std::slice::from_mut(&mut c),
            20,
            Duration::from_millis(1),
        );
        assert_eq!(connected(&c), 1, "the client side is connected");
        assert_eq!(
            f.server.accept_queue.len(),
            1,
            "the server queued it for accept()"
        );
        assert_eq!(f.server.stats.accepted, 1);
    }

    /// Sends the socket refuses for good are counted, and the broker carries on: a
    /// flood of Initials from an address the kernel will not send to made one warning
    /// each (now one at each power of two of the count).
    #[test]
    fn sends_the_socket_refuses_are_counted_and_the_rest_go_on() {
        let mut f = fixture(1000, TransportLimits::default());
        let mut clients: Vec<Driver> = (0..20).map(|i| client(&f, 6100 + i)).collect();
        for (i, c) in clients.iter_mut().enumerate() {
            if i % 2 == 0 {
                f.net.refused.borrow_mut().insert(addr(6100 + i as u16));
            }
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
        }
        run(&mut f, &mut clients, 20, Duration::from_millis(1));
        assert!(
            f.server.stats.send_errors >= 10,
            "{} refused sends counted",
            f.server.stats.send_errors
        );
        assert!(
            super::send_errors_total() >= 10,
            "counted for the process too"
        );
        let reached: usize = clients.iter().map(connected).sum();
        assert_eq!(reached, 10, "the others connected");
    }

    #[test]
    fn stalled_handshakes_are_reclaimed_by_the_idle_timeout() {
        let limits = TransportLimits {
            idle_timeout: Duration::from_secs(10),
            ..TransportLimits::default()
        };
        let mut f = fixture(1000, limits);
        let mut clients: Vec<Driver> = (0..50).map(|i| client(&f, 6000 + i)).collect();
        // The server's answers never arrive: every handshake stalls half way.
        for (i, c) in clients.iter_mut().enumerate() {
            f.net.black_holes.borrow_mut().insert(addr(6000 + i as u16));
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
        }
        run(&mut f, &mut clients, 3, Duration::from_millis(1));
        assert_eq!(
            f.server.conns.len(),
            50,
            "each stalled handshake holds state for now"
        );
        assert_eq!(f.server.stats.accepted, 0);
        // 30 s of virtual time, stepping the server alone once a virtual second.
        for _ in 0..30 {
            f.now += Duration::from_secs(1);
            step(&mut f.server, f.now);
        }
        assert_eq!(
            f.server.conns.len(),
            0,
            "every stalled handshake was reclaimed"
        );
        assert!(f.server.timers.is_empty(), "and its timers with it");
    }

    /// A server restarted with the same reset secret resets its old connections the
    /// moment their peers speak; with another secret the peers wait out the idle
    /// timeout (what brokers saw before their secret was kept on disk).
    #[test]
    fn a_restarted_server_with_its_secret_resets_old_connections_at_once() {
        for (secret_after, reset) in [([7u8; 32], true), ([8u8; 32], false)] {
            let limits = TransportLimits {
                idle_timeout: Duration::from_secs(30),
                ..TransportLimits::default()
            };
            let mut f = fixture(16, limits);
            let (io, cfg) = (f.server.io.clone(), f.server.server.clone());
            f.server = Driver::new(io.clone(), cfg.clone(), 16, Some([7u8; 32])).unwrap();
            let mut c = client(&f, 5100);
            let ccfg = f.client_config.clone();
            c.start_connect(f.now, ccfg, f.server_addr, "localhost")
                .unwrap();
            run(
                &mut f,
                std::slice::from_mut(&mut c),
                20,
                Duration::from_millis(1),
            );
            assert_eq!(connected(&c), 1);
            // The server process restarts: same address, no connection state.
            f.server = Driver::new(io, cfg, 16, Some(secret_after)).unwrap();
            // The client's keepalive (a third of the idle timeout) is its next packet.
            run(
                &mut f,
                std::slice::from_mut(&mut c),
                120,
                Duration::from_millis(100),
            );
            let lost: Vec<_> = c.conns.values().filter_map(|x| x.s.lost.clone()).collect();
            assert_eq!(
                !lost.is_empty(),
                reset,
                "after 12 virtual seconds: reset expected {reset}, lost {lost:?}"
            );
            if reset {
                assert!(matches!(lost[0], quinn_proto::ConnectionError::Reset));
            }
        }
    }

    /// Connects a client at `port` to the fixture's server.
    fn connect(f: &mut Fixture, port: u16) -> Driver {
        let c = try_connect(f, addr(port));
        assert_eq!(connected(&c), 1);
        c
    }

    /// A client at `from` that tried to connect to the fixture's server for 20 steps.
    fn try_connect(f: &mut Fixture, from: SocketAddr) -> Driver {
        let mut c = client_at(f, from);
        let cfg = f.client_config.clone();
        c.start_connect(f.now, cfg, f.server_addr, "localhost")
            .unwrap();
        run(
            f,
            std::slice::from_mut(&mut c),
            20,
            Duration::from_millis(1),
        );
        c
    }

    /// Initials from forged addresses (their answers go nowhere) no longer fill the
    /// connection table: past a quarter of it begun lately, a new connection is sent a
    /// Retry first, holding nothing here, and a real client answers it and connects.
    /// Without it every forged Initial took a slot until its handshake deadline, and
    /// the real client was refused.
    #[test]
    fn initials_from_forged_addresses_cannot_fill_the_connection_table() {
        let mut f = fixture(16, TransportLimits::default());
        let mut forged: Vec<Driver> = (0..16).map(|i| client(&f, 7400 + i)).collect();
        for (i, c) in forged.iter_mut().enumerate() {
            f.net.black_holes.borrow_mut().insert(addr(7400 + i as u16));
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
        }
        run(&mut f, &mut forged, 2, Duration::from_millis(1));
        assert_eq!(
            f.server.conns.len(),
            4,
            "a quarter of the table, then Retries"
        );
        assert_eq!(f.server.stats.retried, 12);
        let mut real = client(&f, 7500);
        let cfg = f.client_config.clone();
        real.start_connect(f.now, cfg, f.server_addr, "localhost")
            .unwrap();
        run(
            &mut f,
            std::slice::from_mut(&mut real),
            20,
            Duration::from_millis(1),
        );
        assert_eq!(
            connected(&real),
            1,
            "the real client connected after its Retry"
        );
        assert_eq!(f.server.stats.refused, 0);
    }

    /// A connection's packet arriving from a forged address is answered there with no
    /// more than three times its size (QUIC's bound on an unvalidated address): with
    /// migration allowed the server sent a 1,200-byte padded path challenge, ~30x.
    #[test]
    fn a_packet_from_a_forged_address_gets_at_most_three_times_its_size_back() {
        let mut f = fixture(16, TransportLimits::default());
        let mut c = connect(&mut f, 5200);
        f.net.queue.borrow_mut().clear();
        let ids: Vec<_> = c.conns.keys().copied().collect();
        for id in ids {
            c.conns.get_mut(&id).unwrap().q.ping();
            c.mark(id);
        }
        step(&mut c, f.now);
        let forged = addr(6666);
        let mut received = 0;
        for (from, to, data) in f.net.queue.borrow_mut().iter_mut() {
            if *to == f.server_addr {
                *from = forged;
                received += data.len();
            }
        }
        assert!(received > 0, "the client pinged");
        step(&mut f.server, f.now);
        let sent: usize = f
            .net
            .queue
            .borrow()
            .iter()
            .filter(|(_, to, _)| *to == forged)
            .map(|(_, _, d)| d.len())
            .sum();
        assert!(
            sent <= 3 * received,
            "{sent} bytes sent to a forged address that sent {received}"
        );
    }

    /// Until the application trusts a connection, its peer may have no more than
    /// [`UNTRUSTED_WINDOW_BYTES`] in flight on all streams together (before, 32 MiB,
    /// out-of-order data included, before proving who it was); widened, it may send on.
    #[test]
    fn an_untrusted_connection_may_send_a_small_window_until_widened() {
        use crate::quic::UNTRUSTED_WINDOW_BYTES;
        let mut f = fixture(16, TransportLimits::default());
        let mut c = connect(&mut f, 5400);
        let id = *c.conns.keys().next().unwrap();
        let data = bytes::Bytes::from(vec![7u8; 4 << 20]);
        let q = &mut c.conns.get_mut(&id).unwrap().q;
        let s = q.streams().open(quinn_proto::Dir::Uni).unwrap();
        let sent = q.send_stream(s).write(&data).unwrap();
        assert_eq!(sent, UNTRUSTED_WINDOW_BYTES as usize);
        // The server trusts it: the window opens.
        let server_id = *f.server.conns.keys().next().unwrap();
        f.server
            .conns
            .get_mut(&server_id)
            .unwrap()
            .q
            .set_receive_window(quinn_proto::VarInt::from_u32(32 << 20));
        f.server.mark(server_id);
        run(
            &mut f,
            std::slice::from_mut(&mut c),
            20,
            Duration::from_millis(1),
        );
        let q = &mut c.conns.get_mut(&id).unwrap().q;
        let more = q.send_stream(s).write(&data[sent..]).unwrap();
        assert!(more > 0, "widened, it sends on");
    }

    /// A connection's windows come from the endpoint's budget: what the server buffers
    /// for it unacknowledged (its send window) is its grant, not the transport's 8 / 32
    /// MiB, and so is what its peer may send ahead once trusted (its receive window),
    /// never less than the credit it began with, which the budget counts. Many
    /// connections of a peer that acknowledges nothing, or sends on streams nobody
    /// reads, could otherwise make a core hold that much each. Until trusted a
    /// connection holds its floor only; trusted, it grows from what is spare.
    #[test]
    fn a_connections_windows_come_from_the_endpoints_budget() {
        use crate::quic::windows::reserved_per_connection;
        use crate::quic::{
            CROWDED_WINDOW_BYTES, UNTRUSTED_WINDOW_BYTES, WINDOW_FLOOR_BYTES, WindowBudget,
            crowded_server_config,
        };
        use quinn_proto::{Dir, WriteError};
        let limits = TransportLimits::default();
        let mut f = fixture(16, limits);
        let base = f.server.server.clone().expect("a server");
        f.server.crowded_server = Some(Arc::new(crowded_server_config(&base, &limits)));
        // 16 connections' reserves and 2 MiB spare.
        let reserves = 16 * reserved_per_connection(u64::from(CROWDED_WINDOW_BYTES));
        let budget = reserves + (2 << 20);
        f.server.set_windows(WindowBudget {
            bytes: budget,
            max_per_direction: 32 << 20,
        });
        let mut c = connect(&mut f, 5600);
        let server_id = *f.server.conns.keys().next().unwrap();
        let each = |f: &Fixture| f.server.conns[&server_id].s.grant.as_ref().unwrap().each();
        assert_eq!(each(&f), WINDOW_FLOOR_BYTES, "untrusted: its floor only");
        let pool = f.server.windows.clone().unwrap();
        assert!(pool.granted() <= budget);
        let written =
            |q: &mut quinn_proto::Connection, s, data: &[u8]| match q.send_stream(s).write(data) {
                Ok(n) => n,
                Err(WriteError::Blocked) => 0,
                Err(e) => panic!("{e}"),
            };
        let data = vec![7u8; 16 << 20];
        // The server sends; the client takes nothing in (its datagrams are lost): the
        // server holds at most its grant, though the client's credit is 8 MiB a stream.
        let sq = &mut f.server.conns.get_mut(&server_id).unwrap().q;
        let s = sq.streams().open(Dir::Uni).unwrap();
        assert_eq!(written(sq, s, &data) as u64, WINDOW_FLOOR_BYTES);
        assert_eq!(written(sq, s, &data), 0);
        // The client sends what its untrusted window allows; trusted, the window is
        // its grant, which grows from what is spare but not past the credit already
        // out here: nothing more until the server reads.
        let id = *c.conns.keys().next().unwrap();
        let q = &mut c.conns.get_mut(&id).unwrap().q;
        let cs = q.streams().open(Dir::Uni).unwrap();
        let sent = written(q, cs, &data);
        assert_eq!(sent, UNTRUSTED_WINDOW_BYTES as usize);
        f.server.set_receive_window(server_id, 32 << 20);
        run(
            &mut f,
            std::slice::from_mut(&mut c),
            20,
            Duration::from_millis(1),
        );
        let grown = each(&f);
        assert!(
            grown > WINDOW_FLOOR_BYTES && grown < u64::from(UNTRUSTED_WINDOW_BYTES),
            "trusted, it grew from what was spare: {grown}"
        );
        assert!(pool.granted() <= budget);
        let q = &mut c.conns.get_mut(&id).unwrap().q;
        assert_eq!(written(q, cs, &data[sent..]), 0, "held to the grant");
        // Connections past what is spare begin with the crowded window.
        let mut windows = Vec::new();
        for port in 5601..5605 {
            let mut c = connect(&mut f, port);
            let id = *c.conns.keys().next().unwrap();
            let q = &mut c.conns.get_mut(&id).unwrap().q;
            let s = q.streams().open(Dir::Uni).unwrap();
            windows.push(written(q, s, &data));
        }
        assert_eq!(
            windows.last(),
            Some(&(CROWDED_WINDOW_BYTES as usize)),
            "{windows:?}"
        );
        assert!(pool.granted() <= budget);
    }

    /// Until trusted, a connection may open [`crate::quic::UNTRUSTED_STREAMS`] streams each
    /// way, not the transport's 1,024: quinn-proto holds up to ~32 KiB of received
    /// datagrams behind each stream's out-of-order pieces whatever the window, so a peer
    /// that never authenticated held some 64 MiB a connection. Trusted, it may open
    /// them all.
    #[test]
    fn an_untrusted_connection_opens_few_streams_until_trusted() {
        use crate::quic::UNTRUSTED_STREAMS;
        use quinn_proto::Dir;
        let mut f = fixture(16, TransportLimits::default());
        let mut c = connect(&mut f, 5700);
        let id = *c.conns.keys().next().unwrap();
        let open_all = |c: &mut Driver, dir| {
            let q = &mut c.conns.get_mut(&id).unwrap().q;
            std::iter::from_fn(|| q.streams().open(dir)).count()
        };
        assert_eq!(open_all(&mut c, Dir::Bi), UNTRUSTED_STREAMS as usize);
        assert_eq!(open_all(&mut c, Dir::Uni), UNTRUSTED_STREAMS as usize);
        let server_id = *f.server.conns.keys().next().unwrap();
        let max = TransportLimits::default().max_streams;
        f.server.set_max_streams(server_id, max, max);
        run(
            &mut f,
            std::slice::from_mut(&mut c),
            20,
            Duration::from_millis(1),
        );
        let more = (max - UNTRUSTED_STREAMS) as usize;
        assert_eq!(open_all(&mut c, Dir::Bi), more);
        assert_eq!(open_all(&mut c, Dir::Uni), more);
    }

    /// A burst the socket takes only partly (sent piece by piece, without GSO) leaves only
    /// its rest waiting for room (the real socket's case: before, the whole burst was
    /// queued again and its first pieces went twice). The rest's later sending, cut by
    /// the segment size, runs in the glommio loop and is not covered here.
    #[test]
    fn a_burst_the_socket_takes_partly_leaves_only_its_rest_waiting() {
        let f = fixture(16, TransportLimits::default());
        let mut d = client(&f, 5800);
        f.net.room.set(Some(2));
        d.send_buf = (0..3000u32).map(|i| i as u8).collect();
        let rest = d.send_buf[2000..].to_vec();
        d.send(3000, addr(9), Some(1000), None);
        let went: Vec<Vec<u8>> = f.net.queue.borrow().iter().map(|q| q.2.clone()).collect();
        assert_eq!(
            went,
            [&d.send_buf[..1000], &d.send_buf[1000..2000]],
            "two pieces went"
        );
        assert_eq!(d.blocked_sends.len(), 1);
        assert_eq!(d.blocked_sends[0].0, rest, "only the rest waits");
    }

    /// An answer of two or three packets is acknowledged by the client's next request,
    /// not by an ACK of its own: the server asks for it (the ACK frequency extension),
    /// and without the ask a quinn client acknowledged every second packet, one more
    /// datagram and wake-up of the server per request. A longer answer is still
    /// acknowledged while it arrives, and a client quiet for longer than the ACK delay
    /// asked for acknowledges on its own.
    #[test]
    fn a_client_acknowledges_a_short_answer_with_its_next_request() {
        use crate::quic::PEER_MAX_ACK_DELAY;
        use quinn_proto::Dir;
        let mut f = fixture(16, TransportLimits::default());
        let mut c = connect(&mut f, 5300);
        let id = *c.conns.keys().next().unwrap();
        let server_id = *f.server.conns.keys().next().unwrap();
        let s = c
            .conns
            .get_mut(&id)
            .unwrap()
            .q
            .streams()
            .open(Dir::Bi)
            .unwrap();
        // One request and its answer of `answer` bytes; what the client sent in the
        // `quiet` ms after the answer.
        let exchange = |f: &mut Fixture, c: &mut Driver, answer: usize, quiet: u32| -> u64 {
            let q = &mut c.conns.get_mut(&id).unwrap().q;
            q.send_stream(s).write(&[1u8; 100]).unwrap();
            c.mark(id);
            step(c, f.now);
            step(&mut f.server, f.now);
            let q = &mut f.server.conns.get_mut(&server_id).unwrap().q;
            // Accepted by the first exchange; the same stream id on both sides.
            let theirs = q.streams().accept(Dir::Bi).unwrap_or(s);
            let mut recv = q.recv_stream(theirs);
            let mut chunks = recv.read(true).unwrap();
            while let Ok(Some(_)) = chunks.next(usize::MAX) {}
            let _ = chunks.finalize();
            let n = q.send_stream(theirs).write(&vec![2u8; answer]).unwrap();
            assert_eq!(n, answer);
            f.server.mark(server_id);
            step(&mut f.server, f.now);
            let sent = c.stats.sends;
            for _ in 0..quiet {
                f.now += Duration::from_millis(1);
                step(c, f.now);
                step(&mut f.server, f.now);
            }
            c.stats.sends - sent
        };
        // The server's ACK_FREQUENCY frame reaches the client with its first answer.
        exchange(&mut f, &mut c, 10, 10);
        // Two- and three-packet answers. The sender skips a packet number now and then
        // (quinn-proto's guard against forged ACKs, ever rarer: the first in 0..64, the
        // next in 64..128, then 128..256), which looks like a loss to the receiver and
        // is acknowledged at once: a few of those, not one ACK per answer.
        // 4 ms after each: under the ACK delay asked for (5 ms), far over a round trip.
        let quiet = (PEER_MAX_ACK_DELAY.as_millis() - 1) as u32;
        let own: u64 = (0..20)
            .map(|_| exchange(&mut f, &mut c, 2500, quiet) + exchange(&mut f, &mut c, 3600, quiet))
            .sum();
        assert!(
            own <= 3,
            "{own} datagrams of the client's own for 40 short answers: short answers wait \
             for the next request to be acknowledged"
        );
        assert!(
            exchange(&mut f, &mut c, 20_000, quiet) >= 1,
            "a longer answer is acknowledged as it arrives"
        );
        // An answer whose first packet is lost: the gap is acknowledged at once, so the
        // loss is found within a round trip, not after the ACK delay.
        f.net.lose_next.borrow_mut().insert(addr(5300));
        assert!(
            exchange(&mut f, &mut c, 2500, 1) >= 1,
            "a gap in the answer is acknowledged at once"
        );
        // Settle the lost packet's recovery first, so what follows counts only the
        // client's own ACK of a quiet answer.
        let quiet = (PEER_MAX_ACK_DELAY.as_millis() + 2) as u32;
        exchange(&mut f, &mut c, 10, quiet);
        assert!(
            exchange(&mut f, &mut c, 2500, quiet) >= 1,
            "a client quiet past the ACK delay acknowledges on its own"
        );
    }

    /// Past `untrusted_full` connections not trusted yet, new ones are accepted with the
    /// crowded config's small window, until one is trusted: ten thousand untrusted
    /// connections a core could each make the server buffer a megabyte (out-of-order
    /// data behind a hole), with no credentials, some 10 GiB.
    #[test]
    fn connections_past_the_untrusted_ones_get_a_small_window() {
        use crate::quic::{CROWDED_WINDOW_BYTES, UNTRUSTED_WINDOW_BYTES, crowded_server_config};
        let limits = TransportLimits::default();
        let mut f = fixture(16, limits);
        let base = f.server.server.clone().expect("a server");
        f.server.crowded_server = Some(Arc::new(crowded_server_config(&base, &limits)));
        f.server.untrusted_full = 2;
        // How much a new client may send before the server reads anything.
        let window = |f: &mut Fixture, port: u16| {
            let mut c = connect(f, port);
            let id = *c.conns.keys().next().unwrap();
            let q = &mut c.conns.get_mut(&id).unwrap().q;
            let s = q.streams().open(quinn_proto::Dir::Uni).unwrap();
            q.send_stream(s).write(&vec![7u8; 4 << 20]).unwrap()
        };
        let full = UNTRUSTED_WINDOW_BYTES as usize;
        assert_eq!(window(&mut f, 5500), full);
        assert_eq!(window(&mut f, 5501), full);
        assert_eq!(window(&mut f, 5502), CROWDED_WINDOW_BYTES as usize);
        assert_eq!(f.server.untrusted.all(), 3);
        // Two are trusted (their windows widened): one untrusted is left, and the next
        // gets the full window again.
        let mut ids: Vec<_> = f.server.conns.keys().copied().collect();
        ids.sort();
        for id in &ids[..2] {
            f.server.set_receive_window(*id, 32 << 20);
        }
        assert_eq!(f.server.untrusted.all(), 1);
        assert_eq!(window(&mut f, 5503), full);
    }

    /// Past `untrusted_per_source` connections from one address that are not trusted
    /// yet, a new one from there is sent a Retry and, its address validated, refused;
    /// other addresses connect as before, and so does that one once one of its
    /// connections is trusted. Without it one host that finished handshakes and never
    /// authenticated could hold the whole table until each one's deadline.
    #[test]
    fn one_address_holds_at_most_its_share_of_connections_not_trusted_yet() {
        let mut f = fixture(16, TransportLimits::default());
        f.server.untrusted_per_source = 2;
        f.server.retry_above = usize::MAX;
        let first = [connect(&mut f, 5600), connect(&mut f, 5601)];
        let try_from = |f: &mut Fixture, from: SocketAddr| connected(&try_connect(f, from));
        let (retried, refused) = (f.server.stats.retried, f.server.stats.refused);
        assert_eq!(
            try_from(&mut f, addr(5602)),
            0,
            "a third from the same address"
        );
        assert_eq!(f.server.stats.retried, retried + 1, "sent a Retry first");
        assert_eq!(f.server.stats.refused, refused + 1, "then refused");
        assert_eq!(
            try_from(&mut f, ([127, 0, 0, 2], 5602).into()),
            1,
            "another address"
        );
        let mut ids: Vec<_> = f.server.conns.keys().copied().collect();
        ids.sort();
        f.server.set_receive_window(ids[0], 32 << 20);
        assert_eq!(try_from(&mut f, addr(5603)), 1, "one of the first trusted");
        // Initials forged from an address (their answers go nowhere) do not spend its
        // share: only a connection whose handshake finished counts.
        let victim = |port: u16| SocketAddr::from(([127, 0, 0, 3], port));
        let mut forged: Vec<Driver> = (0..4)
            .map(|i| {
                f.net.black_holes.borrow_mut().insert(victim(7500 + i));
                client_at(&f, victim(7500 + i))
            })
            .collect();
        for c in forged.iter_mut() {
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
        }
        run(&mut f, &mut forged, 5, Duration::from_millis(1));
        assert_eq!(
            try_from(&mut f, victim(7600)),
            1,
            "the real host at the address"
        );
        // A burst from one address, every Initial in before any handshake finished:
        // at most about twice the share gets in (it all did: the share counted only
        // finished handshakes, and nothing sent a Retry before them).
        let burst = |port: u16| SocketAddr::from(([127, 0, 0, 4], port));
        let mut clients: Vec<Driver> = (0..8).map(|i| client_at(&f, burst(7700 + i))).collect();
        for c in clients.iter_mut() {
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
        }
        run(&mut f, &mut clients, 30, Duration::from_millis(1));
        let connected: usize = clients.iter().map(connected).sum();
        assert!(
            (2..=4).contains(&connected),
            "{connected} of a burst of 8 connected"
        );
        drop(first);
    }

    /// The server advertises no unreliable datagrams (it reads none): a peer's were
    /// buffered, each holding its whole packet, and never read.
    #[test]
    fn the_server_takes_no_unreliable_datagrams() {
        let mut f = fixture(16, TransportLimits::default());
        let mut c = connect(&mut f, 5300);
        let id = *c.conns.keys().next().unwrap();
        assert_eq!(c.conns.get_mut(&id).unwrap().q.datagrams().max_size(), None);
    }

    /// Handshakes never finished are closed at the handshake deadline, whatever the
    /// idle timeout: each packet of the peer's reset that timer, so a peer that kept a
    /// handshake going held its place (at the connection limit, every new client was
    /// refused) for as long as it liked. Here the idle timeout is two minutes.
    #[test]
    fn handshakes_never_finished_are_closed_at_a_deadline() {
        let limits = TransportLimits {
            idle_timeout: Duration::from_secs(120),
            ..TransportLimits::default()
        };
        let mut f = fixture(2, limits);
        // (No Retries: here the table is filled to see the deadline empty it.)
        f.server.retry_above = usize::MAX;
        let mut stalled: Vec<Driver> = (0..2).map(|i| client(&f, 7000 + i)).collect();
        for (i, c) in stalled.iter_mut().enumerate() {
            f.net.black_holes.borrow_mut().insert(addr(7000 + i as u16));
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
        }
        run(&mut f, &mut stalled, 15, Duration::from_secs(1));
        assert_eq!(f.server.stats.handshakes_timed_out, 2);
        let mut honest = client(&f, 7100);
        let cfg = f.client_config.clone();
        honest
            .start_connect(f.now, cfg, f.server_addr, "localhost")
            .unwrap();
        run(
            &mut f,
            std::slice::from_mut(&mut honest),
            20,
            Duration::from_millis(1),
        );
        assert_eq!(
            connected(&honest),
            1,
            "a new client connects ({} refused)",
            f.server.stats.refused
        );
    }

    #[test]
    fn garbage_datagrams_leave_no_state() {
        let mut f = fixture(16, TransportLimits::default());
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for i in 0..500u32 {
            let len = 1 + (i as usize * 37) % 1400;
            let data: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            f.net
                .queue
                .borrow_mut()
                .push_back((addr(7000 + (i % 50) as u16), f.server_addr, data));
        }
        for _ in 0..10 {
            step(&mut f.server, f.now);
            f.now += Duration::from_millis(1);
        }
        assert_eq!(f.server.stats.datagrams_in, 500);
        assert_eq!(
            f.server.conns.len(),
            0,
            "garbage creates no connection state"
        );
        assert!(f.server.accept_queue.is_empty());
    }

    #[test]
    fn a_handle_that_outlives_its_connection_never_reaches_the_next_one() {
        let limits = TransportLimits {
            idle_timeout: Duration::from_secs(5),
            ..TransportLimits::default()
        };
        let Fixture {
            net,
            server,
            server_addr,
            client_config,
            mut now,
        } = fixture(16, limits);
        let server = Rc::new(RefCell::new(server));
        let f = Fixture {
            net: net.clone(),
            server: Driver::new(
                Rc::new(MemIo {
                    addr: addr(1),
                    net: net.clone(),
                }),
                None,
                1,
                None,
            )
            .unwrap(),
            server_addr,
            client_config: client_config.clone(),
            now,
        };
        let step_all = |clients: &mut [&mut Driver], now: &mut Instant, n: usize, dt: Duration| {
            for _ in 0..n {
                for c in clients.iter_mut() {
                    step(c, *now);
                }
                step(&mut server.borrow_mut(), *now);
                *now += dt;
            }
        };
        let accept = || {
            let h = server
                .borrow_mut()
                .accept_queue
                .pop_front()
                .expect("accepted");
            // The accept queue held the connection's first handle; it is ours now.
            super::Connection {
                d: server.clone(),
                h,
            }
        };
        // A connects and is accepted; a session holds its handle (a subscription's
        // stream, say) and keeps holding it after A vanishes without closing.
        let mut a = client(&f, 9001);
        a.start_connect(now, client_config.clone(), server_addr, "localhost")
            .unwrap();
        step_all(&mut [&mut a], &mut now, 20, Duration::from_millis(1));
        let old = accept();
        assert_eq!(old.close_reason(), None, "A is connected");
        net.black_holes.borrow_mut().insert(addr(9001));
        net.black_holes.borrow_mut().insert(server_addr);
        step_all(&mut [], &mut now, 10, Duration::from_secs(1));
        assert!(
            old.close_reason().is_some(),
            "A timed out while its handle lived"
        );
        net.black_holes.borrow_mut().clear();
        // B connects: quinn-proto gives it the slot A's connection freed.
        let mut b = client(&f, 9002);
        b.start_connect(now, client_config.clone(), server_addr, "localhost")
            .unwrap();
        step_all(&mut [&mut b], &mut now, 20, Duration::from_millis(1));
        let new = accept();
        assert_ne!(old.id(), new.id());
        assert_eq!(new.close_reason(), None, "B is connected");
        assert!(
            old.close_reason().is_some(),
            "A's handle still reports A's end, not B's connection"
        );
        assert!(
            futures_lite::future::block_on(old.open_uni()).is_err(),
            "nothing can be written to B through A's handle"
        );
    }

    #[test]
    fn connections_beyond_the_limit_are_refused_in_the_handshake() {
        let mut f = fixture(2, TransportLimits::default());
        let mut clients: Vec<Driver> = (0..3).map(|i| client(&f, 8000 + i)).collect();
        for c in clients.iter_mut() {
            let cfg = f.client_config.clone();
            c.start_connect(f.now, cfg, f.server_addr, "localhost")
                .unwrap();
            // One at a time, so which one is refused is deterministic.
            run(
                &mut f,
                std::slice::from_mut(c),
                20,
                Duration::from_millis(1),
            );
        }
        assert_eq!(f.server.stats.accepted, 2);
        assert_eq!(f.server.stats.refused, 1);
        assert_eq!(connected(&clients[2]), 0, "the third client never connects");
    }
}
