//! `Client`: one broker, one QUIC connection, authenticated streams per purpose.
//!
//! Every stream the client opens authenticates itself with `auth` first. Publishes go
//! over one long-lived, pipelined stream (acks matched by request id); cache operations
//! and discovery requests over one request/response stream; each subscription opens a
//! short-lived request stream and receives its events on a broker-opened unidirectional
//! stream, matched to it by the id in `event_stream_hello`. A `Client` does not
//! reconnect: a dead connection fails its calls (use `ClusterClient`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_wire::flags::FrameKind;
use felix_wire::message::{BrokerEndpoint, PublishRefusalReason, StartPosition};
use felix_wire::{
    AckMode, AckPrefix, EventBatch, Features, Flags, FrameReader, Message, PublishAck,
    PublishAckStatus, PublishBatchHeader, RequestId, ShardId,
};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::config::ClientConfig;
use crate::error::{BrokerError, ClientError, NotLeaderError, SubscribeCursorError};

/// Flags this client reads (everything but publisher names and timestamps).
const CLIENT_FLAGS: Flags = Flags(0x1FFF);

fn client_features() -> Features {
    Features::TOPOLOGY
        | Features::REDIRECT
        | Features::CACHE_DELETE
        | Features::STREAM_SHARDS
        | Features::CACHE_SHARDS
        | Features::ERROR_CODES
        | Features::UNSUPPORTED
        | Features::PUBLISH_PIPELINE
        | Features::STREAM_PUBLISH_WINDOW
        | Features::COUNTERS
        | Features::STREAM_READ
        | Features::RECORD_TIMESTAMPS
        | Features::CACHE_CONDITIONAL
        | Features::IDEMPOTENT_PRODUCER
        | Features::SEQUENCE_REUSED
        | Features::ATOMIC_COMMIT
        | Features::PUBLISH_CONDITIONAL
        | Features::CONSUMER_GROUP
        | Features::GROUP_DEAD_LETTERS
        | Features::GROUP_ADMIN
        | Features::GROUP_CLAIM_CONTROL
        | Features::GROUP_CONSUMER
        | Features::GROUP_SKIPPED
        | Features::SUBSCRIPTION_LAGGED
        | Features::SHARD_MOVED
        | Features::CACHE_WATCH
        | Features::CACHE_WATCH_RETAINED
}

/// What the broker agreed to.
#[derive(Debug, Clone, Copy)]
pub struct Negotiated {
    /// Layouts both sides read.
    pub flags: Flags,
    /// Requests the broker serves (that we offered).
    pub features: Features,
    /// The publish window the broker granted.
    pub publish_window: Option<u32>,
}

/// A delivered record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Tenant.
    pub tenant_id: Arc<str>,
    /// Namespace.
    pub namespace: Arc<str>,
    /// Stream.
    pub stream: Arc<str>,
    /// The record.
    pub payload: Bytes,
    /// Its offset (durable streams).
    pub offset: Option<u64>,
    /// Offsets just before this one that hold no event (not drops).
    pub skipped_before: u64,
}

/// The first offset a `publish_ok` names, or why the publish failed.
fn published_at(answer: Message, what: &'static str) -> Result<u64, ClientError> {
    match answer {
        Message::PublishOk { offset, .. } => offset
            .map(|o| o.0)
            .ok_or_else(|| ClientError::Protocol("publish_ok without the batch's offset".into())),
        other => Err(broker_error(what, other)),
    }
}

pub(crate) fn broker_error(context: &'static str, m: Message) -> ClientError {
    match m {
        Message::Error {
            message,
            code,
            retry,
            detail,
        }
        | Message::PublishError {
            message,
            code,
            retry,
            detail,
            ..
        } => ClientError::Broker(BrokerError {
            retry: retry.or_else(|| code.as_ref().map(felix_wire::ErrorCode::default_retry)),
            code,
            detail,
            message,
            context,
        }),
        // A `not_leader` refusal is followed like a `not_leader` answer, never
        // surfaced as a refusal: a refusal ends an idempotent producer on the shard.
        Message::PublishRefused {
            reason: PublishRefusalReason::NotLeader { node_id, addr },
            ..
        } => ClientError::NotLeader(NotLeaderError {
            node_id,
            addr,
            generation: 0,
        }),
        Message::PublishRefused {
            reason, message, ..
        } => ClientError::Refused { reason, message },
        Message::NotLeader {
            node_id,
            addr,
            generation,
        } => ClientError::NotLeader(NotLeaderError {
            node_id,
            addr,
            generation: generation.0,
        }),
        Message::SubscribeCursorError {
            reason,
            requested,
            available,
        } => ClientError::Cursor(SubscribeCursorError {
            reason,
            requested: requested.0,
            available: available.0,
        }),
        // The broker ran nothing: not a protocol failure, which would be taken for a
        // suspect connection and an outcome in doubt.
        Message::Unsupported { .. } => ClientError::Unsupported(context),
        other => ClientError::Protocol(format!("{context}: unexpected answer {other:?}")),
    }
}

pub(crate) struct Stream {
    pub(crate) send: quinn::SendStream,
    pub(crate) recv: quinn::RecvStream,
    reader: FrameReader,
}

pub(crate) async fn read_frame(
    recv: &mut quinn::RecvStream,
    reader: &mut FrameReader,
) -> Result<Option<felix_wire::Frame>, ClientError> {
    loop {
        if let Some(f) = reader
            .next_frame()
            .map_err(|e| ClientError::Protocol(e.to_string()))?
        {
            return Ok(Some(f));
        }
        match recv.read_chunk(1 << 20, true).await {
            Ok(Some(c)) => reader.push(c.bytes),
            Ok(None) => return Ok(None),
            Err(quinn::ReadError::ConnectionLost(why)) => {
                return Err(ClientError::connection(
                    "broker",
                    format!("connection lost: {why}"),
                ));
            }
            Err(e) => return Err(ClientError::connection("broker", e)),
        }
    }
}

pub(crate) async fn read_message(
    s: &mut Stream,
    context: &'static str,
) -> Result<Message, ClientError> {
    let f = read_frame(&mut s.recv, &mut s.reader)
        .await?
        .ok_or_else(|| {
            ClientError::connection(
                "broker",
                format!("{context}: stream ended without an answer"),
            )
        })?;
    Message::decode(&f.payload).map_err(|e| ClientError::Protocol(format!("{context}: {e}")))
}

/// Acked publishes waiting for their answer, by request id.
type PendingAcks = Arc<std::sync::Mutex<AckWaiters>>;

/// A publish's ack: its offset when the broker sends one.
type AckAnswer = Result<Option<u64>, ClientError>;

/// The publishes of one publish stream waiting for their ack.
#[derive(Default)]
struct AckWaiters {
    waiting: HashMap<u64, oneshot::Sender<AckAnswer>>,
    /// The stream's acks reader stopped (and failed every publish waiting then): one
    /// registering after would never be answered and wait out its timeout.
    ended: bool,
}

/// The connection's long-lived publish stream, the task reading its acks, and the
/// publishes waiting for one.
struct PublishStream {
    send: quinn::SendStream,
    /// How the stream ended (see [`AcksEnd`]).
    acks: tokio::task::JoinHandle<AcksEnd>,
    pending: PendingAcks,
    /// Whether a publish owed no ack was sent on it: lost unseen should the stream end
    /// before the broker read it.
    unacked_sent: bool,
}

impl PublishStream {
    /// Its acks reader stopped: a publish sent on it would go unread or unanswered.
    fn ended(&self) -> bool {
        self.acks.is_finished() || self.pending.lock().expect("acks lock").ended
    }
}

/// A publish's place in [`PendingAcks`], given up when the call ends, answered or not
/// (timed out, cancelled, failed to send): left behind, every abandoned publish kept
/// its entry for the connection's life.
struct AckSlot {
    acks: PendingAcks,
    id: u64,
}

impl Drop for AckSlot {
    fn drop(&mut self) {
        if let Ok(mut acks) = self.acks.lock() {
            acks.waiting.remove(&self.id);
        }
    }
}

/// Holds the publish stream while a frame is written to it. Dropped before the write
/// completes (the caller's future cancelled part way), the stream holds part of a
/// frame that the next publish's would follow, and the broker would read the two as
/// one garbled frame: the stream is reset and forgotten, and the next publish opens
/// another.
///
/// Publishes owed no ack sent on it before (or this one) may not have been read: the
/// loss is kept for [`Client::flush_publishes`], as when a stream is replaced.
struct Writing<'a> {
    stream: Option<&'a mut Option<PublishStream>>,
    lost: &'a std::sync::Mutex<Option<ClientError>>,
    addr: SocketAddr,
}

impl Writing<'_> {
    fn done(mut self) {
        self.stream = None;
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.stream.take()
            && let Some(mut p) = slot.take()
        {
            let _ = p.send.reset(quinn::VarInt::from_u32(0));
            if p.unacked_sent {
                // A poisoned lock only means another thread panicked holding it.
                let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
                lost.get_or_insert_with(|| {
                    ClientError::connection(
                        self.addr,
                        "a publish stream was reset with publishes owed no ack on it, \
                         which the broker may not have read",
                    )
                });
            }
        }
    }
}

#[derive(Default)]
struct Router {
    waiting: HashMap<u64, oneshot::Sender<(quinn::RecvStream, FrameReader)>>,
    early: HashMap<u64, (quinn::RecvStream, FrameReader)>,
}

struct Inner {
    addr: SocketAddr,
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    config: ClientConfig,
    negotiated: Negotiated,
    publish: Mutex<Option<PublishStream>>,
    /// The first loss of publishes owed no ack on a publish stream since replaced (see
    /// [`Client::note_publish_stream_end`]), reported by the next flush.
    unacked_lost: std::sync::Mutex<Option<ClientError>>,
    /// Acked publishes in flight: `publish_window`, or the broker's when smaller.
    publish_window: tokio::sync::Semaphore,
    requests: Mutex<Option<Stream>>,
    router: Arc<std::sync::Mutex<Router>>,
    /// The task handing the broker's event streams to subscriptions. It holds the
    /// connection, so it ends with the last handle to the client: otherwise a dropped
    /// client's connection (and the broker's resources for it) lived on until the
    /// process exited. Subscriptions already made keep their own streams, and with them
    /// the connection, until they are dropped too.
    routing: tokio::task::AbortHandle,
    next_id: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.routing.abort();
    }
}

/// A client of one broker.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl Client {
    /// Connects to `addr`, verifying its certificate for `server_name`, and
    /// authenticates once to learn what the broker serves.
    pub async fn connect(
        addr: SocketAddr,
        server_name: &str,
        config: ClientConfig,
    ) -> Result<Client, ClientError> {
        config.tenant()?;
        let bind: SocketAddr = if addr.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .expect("valid bind address");
        let mut endpoint =
            quinn::Endpoint::client(bind).map_err(|e| ClientError::connection(addr, e))?;
        endpoint.set_default_client_config(config.quinn.clone());
        let conn = endpoint
            .connect(addr, server_name)
            .map_err(|e| ClientError::connection(addr, e))?
            .await
            .map_err(|e| ClientError::connection(addr, e))?;
        let (requests, negotiated) = open_stream(&conn, &config, addr).await?;
        let router: Arc<std::sync::Mutex<Router>> = Arc::default();
        let routing = tokio::spawn(route_event_streams(
            conn.clone(),
            router.clone(),
            config.max_frame_bytes,
            config.request_timeout,
        ))
        .abort_handle();
        let window = negotiated
            .publish_window
            .map_or(usize::MAX, |w| w as usize)
            .min(config.publish_window)
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        Ok(Client {
            inner: Arc::new(Inner {
                addr,
                _endpoint: endpoint,
                conn,
                config,
                negotiated,
                publish: Mutex::new(None),
                unacked_lost: std::sync::Mutex::new(None),
                publish_window: tokio::sync::Semaphore::new(window),
                requests: Mutex::new(Some(requests)),
                router,
                routing,
                next_id: AtomicU64::new(1),
            }),
        })
    }

    /// The broker's address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// What the broker agreed to.
    pub fn negotiated(&self) -> Negotiated {
        self.inner.negotiated
    }

    /// Whether the connection is closed.
    pub fn is_closed(&self) -> bool {
        self.inner.conn.close_reason().is_some()
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn require(&self, f: Features, what: &'static str) -> Result<(), ClientError> {
        if self.inner.negotiated.features.contains(f) {
            Ok(())
        } else {
            Err(ClientError::Unsupported(what))
        }
    }

    pub(crate) fn check_tenant(&self, tenant: &str) -> Result<(), ClientError> {
        let mine = self.inner.config.tenant()?;
        if tenant != mine {
            return Err(ClientError::Config(format!(
                "tenant mismatch: client auth is scoped to {mine}, request names {tenant}"
            )));
        }
        Ok(())
    }

    /// Sends `m` on a stream of its own and reads its one answer, allowing `wait` beyond
    /// the request timeout (a long poll). Group requests go this way, so a waiting poll
    /// holds up nothing else.
    pub(crate) async fn request_on_own_stream(
        &self,
        m: Message,
        context: &'static str,
        wait: Duration,
    ) -> Result<Message, ClientError> {
        let frame = m.to_frame();
        self.check_frame_len(&frame)?;
        let (mut s, _) = open_stream(&self.inner.conn, &self.inner.config, self.inner.addr).await?;
        s.send
            .write_all(&frame)
            .await
            .map_err(|e| ClientError::connection(self.inner.addr, e))?;
        let answer = tokio::time::timeout(
            self.inner.config.request_timeout + wait,
            read_message(&mut s, context),
        )
        .await
        .map_err(|_| ClientError::Timeout(context))?;
        let _ = s.send.finish();
        answer
    }

    /// Refuses, before anything is sent, a frame larger than a broker takes (the
    /// protocol's 16 MiB, or `max_frame_bytes` when smaller): the broker would end the stream on its
    /// header, and the caller would learn only that the connection failed, the write's
    /// outcome unknown though nothing was written.
    fn check_frame_len(&self, frame: &[u8]) -> Result<(), ClientError> {
        let payload = frame.len().saturating_sub(felix_wire::frame::HEADER_LEN);
        let max = self
            .inner
            .config
            .max_frame_bytes
            .min(felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize);
        if payload > max {
            return Err(ClientError::Config(format!(
                "a request of {payload} bytes is larger than a frame may be ({max} bytes, \
                 max_frame_bytes); nothing was sent"
            )));
        }
        Ok(())
    }

    /// One request, one answer, on the shared request stream.
    async fn request(&self, m: Message, context: &'static str) -> Result<Message, ClientError> {
        let frame = m.to_frame();
        self.check_frame_len(&frame)?;
        let mut guard = self.inner.requests.lock().await;
        // Taken out while in use and put back only once its answer is read: a request
        // dropped part way (a caller's timeout, a cancelled task) would otherwise leave
        // its answer on the stream for the next request to take as its own.
        let mut s = match guard.take() {
            Some(s) => s,
            None => {
                open_stream(&self.inner.conn, &self.inner.config, self.inner.addr)
                    .await?
                    .0
            }
        };
        let sent = m.request_id();
        let result = async {
            s.send
                .write_all(&frame)
                .await
                .map_err(|e| ClientError::connection(self.inner.addr, e))?;
            let answer = tokio::time::timeout(
                self.inner.config.request_timeout,
                read_message(&mut s, context),
            )
            .await
            .map_err(|_| ClientError::Timeout(context))??;
            match (sent, answer.request_id()) {
                (Some(asked), Some(got)) if asked != got => Err(ClientError::Protocol(format!(
                    "{context}: an answer to request {} came for request {}",
                    got.0, asked.0
                ))),
                _ => Ok(answer),
            }
        }
        .await;
        // An `error` naming no request answers one the broker could not read, and it
        // may have ended the stream after it (a frame it could not stay aligned on).
        let unread = matches!(&result, Ok(m @ Message::Error { .. }) if m.request_id().is_none());
        if !unread
            && !matches!(
                result,
                Err(ClientError::Connection { .. }
                    | ClientError::Timeout(_)
                    | ClientError::Protocol(_))
            )
        {
            // Otherwise the stream's state is unknown: the next request opens a fresh one.
            *guard = Some(s);
        }
        result
    }

    /// Publishes one record; returns its offset when the broker's ack carries one.
    pub async fn publish(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        payload: Vec<u8>,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        self.publish_batch_inner(
            tenant,
            namespace,
            stream,
            None,
            vec![Bytes::from(payload)],
            ack,
        )
        .await
    }

    /// Publishes one record under a routing key.
    pub async fn publish_keyed(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        key: Bytes,
        payload: Vec<u8>,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        self.publish_batch_inner(
            tenant,
            namespace,
            stream,
            Some(key),
            vec![Bytes::from(payload)],
            ack,
        )
        .await
    }

    /// Publishes several records as one batch; returns the first offset.
    pub async fn publish_batch(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        payloads: Vec<Vec<u8>>,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        self.publish_batch_inner(
            tenant,
            namespace,
            stream,
            None,
            payloads.into_iter().map(Bytes::from).collect(),
            ack,
        )
        .await
    }

    async fn publish_batch_inner(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        key: Option<Bytes>,
        payloads: Vec<Bytes>,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        if payloads.is_empty() {
            return Err(ClientError::Config(
                "a publish needs at least one record".into(),
            ));
        }
        check_batch_len(payloads.len())?;
        let flags = self.inner.negotiated.flags;
        let binary = flags.contains(Flags::BINARY_PUBLISH_BATCH)
            && (ack == AckMode::None || flags.contains(Flags::BINARY_PUBLISH_ACKED))
            && (key.is_none() || flags.contains(Flags::BINARY_PUBLISH_KEYED));
        let id = self.next_id();
        let mut frame = BytesMut::new();
        if binary {
            PublishBatchHeader {
                tenant,
                namespace,
                stream,
                ack: (ack != AckMode::None).then_some(AckPrefix {
                    request_id: RequestId(id),
                    ack_mode: ack,
                }),
                idempotent: None,
                key: key.as_deref(),
            }
            .encode_frame(&mut frame, &payloads)
            .map_err(|e| ClientError::Config(e.to_string()))?;
        } else {
            let request_id = (ack != AckMode::None).then_some(RequestId(id));
            let ack = Some(match (ack, payloads.len()) {
                (AckMode::None, _) => AckMode::None,
                (_, 1) => AckMode::PerMessage,
                _ => AckMode::PerBatch,
            });
            let m = if payloads.len() == 1 {
                Message::Publish {
                    tenant_id: tenant.into(),
                    namespace: namespace.into(),
                    stream: stream.into(),
                    payload: payloads.into_iter().next().expect("one payload"),
                    key,
                    shard: None,
                    request_id,
                    ack,
                }
            } else {
                Message::PublishBatch {
                    tenant_id: tenant.into(),
                    namespace: namespace.into(),
                    stream: stream.into(),
                    payloads,
                    key,
                    shard: None,
                    request_id,
                    ack,
                }
            };
            m.encode_frame(&mut frame)
                .map_err(|e| ClientError::Config(e.to_string()))?;
        }
        self.check_frame_len(&frame)?;
        // Held until the ack (or the call's end): past the window, a publish waits here.
        let _in_flight = match ack {
            AckMode::None => None,
            _ => Some(
                self.inner
                    .publish_window
                    .acquire()
                    .await
                    .expect("never closed"),
            ),
        };
        let rx = {
            let mut publish = self.inner.publish.lock().await;
            // Registered with this stream's reader: one that ends fails only what was
            // sent on it.
            let rx = loop {
                if publish.as_ref().is_none_or(PublishStream::ended) {
                    // None yet, or its acks reader ended (the broker finished or reset
                    // the stream): a publish written there would wait out its timeout
                    // unread.
                    if let Some(old) = publish.take() {
                        self.note_publish_stream_end(old).await;
                    }
                    let (s, _) =
                        open_stream(&self.inner.conn, &self.inner.config, self.inner.addr).await?;
                    let pending = PendingAcks::default();
                    let acks = tokio::spawn(read_acks(
                        s.recv,
                        s.reader,
                        pending.clone(),
                        self.inner.addr,
                    ));
                    *publish = Some(PublishStream {
                        send: s.send,
                        acks,
                        pending,
                        unacked_sent: false,
                    });
                }
                let p = publish.as_mut().expect("just opened");
                if ack == AckMode::None {
                    // Marked once written: one whose write fails is this call's error
                    // alone (it was also the next flush's, reported twice, until
                    // 2026-12-08); the stream's reset then reports those before it.
                    break None;
                }
                match register_ack(&p.pending, id) {
                    Some(waiting) => break Some(waiting),
                    // It ended since the look above: another stream.
                    None => continue,
                }
            };
            let mut writing = Writing {
                stream: Some(&mut *publish),
                lost: &self.inner.unacked_lost,
                addr: self.inner.addr,
            };
            let send = writing
                .stream
                .as_mut()
                .and_then(|s| s.as_mut())
                .map(|p| &mut p.send)
                .expect("just opened");
            match send.write_all(&frame).await {
                Ok(()) => writing.done(),
                // Dropping `writing` resets the stream and forgets it.
                Err(e) => return Err(ClientError::connection(self.inner.addr, e)),
            }
            if rx.is_none()
                && let Some(p) = publish.as_mut()
            {
                p.unacked_sent = true;
            }
            rx
        };
        match rx {
            None => Ok(None),
            Some((rx, _slot)) => {
                match tokio::time::timeout(self.inner.config.request_timeout, rx).await {
                    Ok(Ok(r)) => r,
                    Ok(Err(_)) => Err(ClientError::connection(
                        self.inner.addr,
                        "publish stream closed before the ack",
                    )),
                    Err(_) => Err(ClientError::Timeout("publish ack")),
                }
            }
        }
    }

    /// Looks at how a publish stream being replaced ended: a refusal of a publish owed
    /// no ack, or an end before the broker read it all with such publishes sent on it,
    /// is kept for [`Client::flush_publishes`] (the first one). Replaced in silence,
    /// the `felix` command exited 0 after publishes refused or never read.
    async fn note_publish_stream_end(&self, old: PublishStream) {
        // Its reader stopped (or is about to): the task returns at once.
        let lost = match tokio::time::timeout(Duration::from_secs(1), old.acks).await {
            Ok(Ok(AcksEnd {
                unacked_refused: Some(e),
                ..
            })) => Some(e),
            Ok(Ok(AcksEnd { clean: true, .. })) => None,
            _ if old.unacked_sent => Some(ClientError::connection(
                self.inner.addr,
                "a publish stream failed before the broker read it to its end",
            )),
            _ => None,
        };
        if let Some(e) = lost {
            self.inner
                .unacked_lost
                .lock()
                .expect("unacked lock")
                .get_or_insert(e);
        }
    }

    /// Whether a flush has anything to say: publishes owed no ack sent on the stream in
    /// use, or a loss of such publishes not yet reported. A stream in use by a call (its
    /// lock held) counts as owing.
    pub(crate) fn owes_unacked(&self) -> bool {
        self.inner
            .unacked_lost
            .lock()
            .expect("unacked lock")
            .is_some()
            || self
                .inner
                .publish
                .try_lock()
                .map_or(true, |p| p.as_ref().is_some_and(|p| p.unacked_sent))
    }

    /// Waits until the broker has read every publish sent so far on this connection's
    /// publish stream, those sent without an ack included: the stream is finished and
    /// its acks reader runs to the broker's end of it (the next publish opens another).
    /// A publish without an ack returns once its bytes are in the send buffer; a
    /// process that exits then (the `felix` command) loses them without this. The
    /// first such publish the broker refused since the stream opened (it could not
    /// read it) is the error.
    ///
    /// The stream in use is finished and waited for even when an earlier one's loss is
    /// the answer: a caller that exits after the error must not lose what it sent since.
    pub async fn flush_publishes(&self) -> Result<(), ClientError> {
        let taken = self.inner.publish.lock().await.take();
        let now = match taken {
            Some(p) => self.finish_publish_stream(p).await,
            None => Ok(()),
        };
        let earlier = self.inner.unacked_lost.lock().expect("unacked lock").take();
        match earlier {
            Some(e) => Err(e),
            None => now,
        }
    }

    /// Finishes a publish stream and waits until the broker has read it to its end.
    async fn finish_publish_stream(&self, mut p: PublishStream) -> Result<(), ClientError> {
        p.send
            .finish()
            .map_err(|e| ClientError::connection(self.inner.addr, e))?;
        match tokio::time::timeout(self.inner.config.request_timeout, p.acks).await {
            Ok(Ok(AcksEnd {
                unacked_refused: Some(e),
                ..
            })) => Err(e),
            Ok(Ok(AcksEnd { clean: true, .. })) => Ok(()),
            // The connection failed or the broker reset the stream: what it had not
            // read is lost.
            Ok(_) => Err(ClientError::connection(
                self.inner.addr,
                "the publish stream failed before the broker read it to its end",
            )),
            Err(_) => Err(ClientError::Timeout("flushing publishes")),
        }
    }

    /// Shard count of a stream (0 = the broker does not know it).
    pub async fn stream_shards(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<u32, ClientError> {
        self.require(Features::STREAM_SHARDS, "stream_shards")?;
        let request_id = RequestId(self.next_id());
        match self
            .request(
                Message::StreamShards {
                    tenant_id: tenant.into(),
                    namespace: namespace.into(),
                    stream: stream.into(),
                    request_id,
                },
                "stream_shards",
            )
            .await?
        {
            Message::StreamShardsView { shards, .. } => Ok(shards),
            other => Err(broker_error("stream_shards", other)),
        }
    }

    /// Brokers a client may use (empty on a single node).
    pub async fn topology(&self) -> Result<Vec<BrokerEndpoint>, ClientError> {
        self.require(Features::TOPOLOGY, "topology")?;
        match self.request(Message::Topology, "topology").await? {
            Message::TopologyView { brokers } => Ok(brokers),
            other => Err(broker_error("topology", other)),
        }
    }

    /// Adds a signed delta to a counter beside the cache and returns the sum including
    /// it. At-least-once: an add retried after a lost answer counts twice.
    pub async fn counter_add(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        delta: i64,
    ) -> Result<i64, ClientError> {
        self.require(Features::COUNTERS, "counter_add")?;
        let m = Message::CounterAdd {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            cache: cache.into(),
            key: key.into(),
            delta,
            request_id: RequestId(self.next_id()),
        };
        match self.request(m, "counter_add").await? {
            Message::CounterValue { value, .. } => Ok(value.unwrap_or(delta)),
            other => Err(broker_error("counter_add", other)),
        }
    }

    /// Reads a counter: `None` when never written (which is not zero).
    pub async fn counter_get(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<i64>, ClientError> {
        self.require(Features::COUNTERS, "counter_get")?;
        let m = Message::CounterGet {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            cache: cache.into(),
            key: key.into(),
            request_id: RequestId(self.next_id()),
        };
        match self.request(m, "counter_get").await? {
            Message::CounterValue { value, .. } => Ok(value),
            other => Err(broker_error("counter_get", other)),
        }
    }

    /// Records of shard `shard` from `from` up to `end` (exclusive; as far as the log
    /// goes when `None`), at most `max_records`; and the offset the next read starts
    /// at. Served by the shard's leader only.
    #[allow(clippy::too_many_arguments)]
    pub async fn stream_read(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
    ) -> Result<(Vec<felix_wire::message::StreamRecord>, u64), ClientError> {
        self.require(Features::STREAM_READ, "stream_read")?;
        let m = Message::StreamRead {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            shard: felix_wire::ShardId(shard),
            from: felix_wire::Offset(from),
            end: end.map(felix_wire::Offset),
            max_records,
            max_bytes: None,
            request_id: RequestId(self.next_id()),
        };
        match self
            .request_on_own_stream(m, "stream_read", Duration::ZERO)
            .await?
        {
            Message::StreamRecords {
                records,
                next_offset,
                ..
            } => Ok((records, next_offset.0)),
            other => Err(broker_error("stream_read", other)),
        }
    }

    /// The first offset of shard `shard` appended at or after `at_micros` (microseconds
    /// since the Unix epoch); `None` when nothing is, yet.
    pub async fn offset_for_time(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        at_micros: u64,
    ) -> Result<Option<u64>, ClientError> {
        self.require(Features::RECORD_TIMESTAMPS, "offset_for_time")?;
        let m = Message::OffsetForTime {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            shard: felix_wire::ShardId(shard),
            at_micros,
            request_id: RequestId(self.next_id()),
        };
        match self
            .request_on_own_stream(m, "offset_for_time", Duration::ZERO)
            .await?
        {
            Message::OffsetValue { offset, .. } => Ok(offset.map(|o| o.0)),
            other => Err(broker_error("offset_for_time", other)),
        }
    }

    /// Asks the broker for an idempotent producer id (random, 64 bits).
    pub async fn producer_init(&self) -> Result<u64, ClientError> {
        self.require(Features::IDEMPOTENT_PRODUCER, "producer_init")?;
        let m = Message::ProducerInit {
            request_id: RequestId(self.next_id()),
        };
        match self
            .request_on_own_stream(m, "producer_init", Duration::ZERO)
            .await?
        {
            Message::ProducerInitOk { producer_id, .. } => Ok(producer_id.0),
            other => Err(broker_error("producer_init", other)),
        }
    }

    /// Publishes batch `sequence` of idempotent producer `producer_id` to `shard` (0
    /// when `None`): appended once however often it is re-sent. Returns the batch's
    /// first offset. The sequence rules are the caller's (see
    /// [`crate::IdempotentProducer`], which keeps them).
    #[allow(clippy::too_many_arguments)]
    pub async fn publish_idempotent(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: Option<u32>,
        payloads: Vec<Bytes>,
        producer_id: u64,
        sequence: u64,
    ) -> Result<u64, ClientError> {
        self.require(Features::IDEMPOTENT_PRODUCER, "publish_idempotent")?;
        check_batch_len(payloads.len())?;
        let m = Message::PublishIdempotent {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            payloads,
            key: None,
            shard: shard.map(felix_wire::ShardId),
            request_id: RequestId(self.next_id()),
            producer_id: felix_wire::ProducerId(producer_id),
            sequence: felix_wire::Sequence(sequence),
        };
        published_at(
            self.request(m, "publish_idempotent").await?,
            "publish_idempotent",
        )
    }

    /// Publishes `payloads` as one batch to `shard` (0 when `None`) only if the shard's
    /// next offset is `expected_offset`: returns the batch's first offset (that one), or
    /// [`ClientError::Refused`] with `offset_mismatch` naming the tail, nothing written.
    pub async fn publish_if(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: Option<u32>,
        payloads: Vec<Bytes>,
        expected_offset: u64,
    ) -> Result<u64, ClientError> {
        self.require(Features::PUBLISH_CONDITIONAL, "publish_if")?;
        check_batch_len(payloads.len())?;
        let m = Message::PublishIf {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            payloads,
            key: None,
            shard: shard.map(felix_wire::ShardId),
            expected_offset: felix_wire::Offset(expected_offset),
            request_id: RequestId(self.next_id()),
        };
        published_at(self.request(m, "publish_if").await?, "publish_if")
    }

    /// Commits `event` and `changes` as one record on the shard of `stream` that
    /// `entity_key` routes to: every reader sees all of it or none. Returns the event's
    /// offset, the version of every key written. With `expected_offset`, only if the
    /// shard's next offset is that (a `PublishRefused` with `offset_mismatch` otherwise).
    #[allow(clippy::too_many_arguments)]
    pub async fn commit(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        entity_key: &str,
        event: Bytes,
        changes: Vec<felix_wire::message::StateChange>,
        expected_offset: Option<u64>,
    ) -> Result<u64, ClientError> {
        self.require(Features::ATOMIC_COMMIT, "commit")?;
        if expected_offset.is_some() {
            self.require(
                Features::PUBLISH_CONDITIONAL,
                "commit with an expected offset",
            )?;
        }
        let m = Message::Commit {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            entity_key: Bytes::copy_from_slice(entity_key.as_bytes()),
            event,
            changes,
            request_id: RequestId(self.next_id()),
            expected_offset: expected_offset.map(felix_wire::Offset),
        };
        match self
            .request_on_own_stream(m, "commit", Duration::ZERO)
            .await?
        {
            Message::CommitOk { offset, .. } => Ok(offset.0),
            other => Err(broker_error("commit", other)),
        }
    }

    /// One key of the state of the shard of `stream` that `entity_key` routes to:
    /// `(value, version)`, and the offset the answer is as of.
    pub async fn state_get(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        entity_key: &str,
        key: &str,
    ) -> Result<(Option<(Bytes, u64)>, Option<u64>), ClientError> {
        self.require(Features::ATOMIC_COMMIT, "state_get")?;
        let m = Message::StateGet {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            entity_key: Bytes::copy_from_slice(entity_key.as_bytes()),
            key: key.into(),
            request_id: RequestId(self.next_id()),
        };
        match self
            .request_on_own_stream(m, "state_get", Duration::ZERO)
            .await?
        {
            Message::StateValue {
                value,
                version,
                as_of,
                ..
            } => Ok((value.map(|v| (v, version.unwrap_or(0))), as_of.map(|o| o.0))),
            other => Err(broker_error("state_get", other)),
        }
    }

    /// Sets a cache key only if `condition` holds (absent, or at a version: the offset
    /// of the put that wrote it). Returns whether it applied and the version (the new
    /// one when applied, the current one, if any, when not).
    #[allow(clippy::too_many_arguments)]
    pub async fn cache_put_if(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
        condition: felix_wire::message::CacheCondition,
    ) -> Result<(bool, Option<u64>), ClientError> {
        self.require(Features::CACHE_CONDITIONAL, "cache_put_if")?;
        let m = Message::CachePutIf {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            cache: cache.into(),
            key: key.into(),
            value,
            ttl_ms,
            condition,
            request_id: RequestId(self.next_id()),
        };
        match self.request(m, "cache_put_if").await? {
            Message::CacheConditionResult {
                applied, version, ..
            } => Ok((applied, version)),
            other => Err(broker_error("cache_put_if", other)),
        }
    }

    /// Removes a cache key only if its version is `version`; whether it applied.
    pub async fn cache_delete_if(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        version: u64,
    ) -> Result<bool, ClientError> {
        self.require(Features::CACHE_CONDITIONAL, "cache_delete_if")?;
        let m = Message::CacheDeleteIf {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            cache: cache.into(),
            key: key.into(),
            version,
            request_id: RequestId(self.next_id()),
        };
        match self.request(m, "cache_delete_if").await? {
            Message::CacheConditionResult { applied, .. } => Ok(applied),
            other => Err(broker_error("cache_delete_if", other)),
        }
    }

    /// Sets a cache key, with an optional time to live.
    pub async fn cache_put(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
    ) -> Result<(), ClientError> {
        let request_id = Some(RequestId(self.next_id()));
        match self
            .request(
                Message::CachePut {
                    tenant_id: tenant.into(),
                    namespace: namespace.into(),
                    cache: cache.into(),
                    key: key.into(),
                    value,
                    request_id,
                    ttl_ms,
                },
                "cache_put",
            )
            .await?
        {
            Message::CacheOk { .. } => Ok(()),
            other => Err(broker_error("cache_put", other)),
        }
    }

    /// Reads a cache key (`None` when missing or expired).
    pub async fn cache_get(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<Bytes>, ClientError> {
        let (value, _) = self
            .cache_value(tenant, namespace, cache, key, "cache_get")
            .await?;
        Ok(value)
    }

    /// Reads a cache key with its version (the offset of the put that wrote it), for a
    /// read-modify-write with [`Client::cache_put_if`]; `None` when missing or expired.
    pub async fn cache_get_versioned(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<(Bytes, u64)>, ClientError> {
        self.require(Features::CACHE_CONDITIONAL, "cache_get_versioned")?;
        match self
            .cache_value(tenant, namespace, cache, key, "cache_get_versioned")
            .await?
        {
            (Some(value), Some(version)) => Ok(Some((value, version))),
            (None, _) => Ok(None),
            (Some(_), None) => Err(ClientError::Protocol(
                "cache_get_versioned: the broker sent a value without its version".into(),
            )),
        }
    }

    /// A `cache_get`'s answer: the value and, to a client that negotiated
    /// `CACHE_CONDITIONAL`, its version.
    async fn cache_value(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        what: &'static str,
    ) -> Result<(Option<Bytes>, Option<u64>), ClientError> {
        let request_id = Some(RequestId(self.next_id()));
        match self
            .request(
                Message::CacheGet {
                    tenant_id: tenant.into(),
                    namespace: namespace.into(),
                    cache: cache.into(),
                    key: key.into(),
                    request_id,
                },
                what,
            )
            .await?
        {
            Message::CacheValue { value, version, .. } => Ok((value, version)),
            other => Err(broker_error(what, other)),
        }
    }

    /// Removes a cache key; returns the value it had.
    pub async fn cache_delete(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<Bytes>, ClientError> {
        self.require(Features::CACHE_DELETE, "cache_delete")?;
        let request_id = Some(RequestId(self.next_id()));
        match self
            .request(
                Message::CacheDelete {
                    tenant_id: tenant.into(),
                    namespace: namespace.into(),
                    cache: cache.into(),
                    key: key.into(),
                    request_id,
                },
                "cache_delete",
            )
            .await?
        {
            Message::CacheValue { value, .. } => Ok(value),
            other => Err(broker_error("cache_delete", other)),
        }
    }

    /// Subscribes to shard 0 from the tail.
    pub async fn subscribe(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<Subscription, ClientError> {
        self.subscribe_shard(tenant, namespace, stream, 0, None)
            .await
    }

    /// Subscribes to shard 0 from `start`.
    pub async fn subscribe_from(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
    ) -> Result<Subscription, ClientError> {
        self.subscribe_shard(tenant, namespace, stream, 0, start)
            .await
    }

    /// Subscribes to one shard from `start` (absent = latest).
    pub async fn subscribe_shard(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        start: Option<StartPosition>,
    ) -> Result<Subscription, ClientError> {
        self.check_tenant(tenant)?;
        if matches!(
            start,
            Some(StartPosition::Earliest | StartPosition::Offset(_))
        ) && !self
            .inner
            .negotiated
            .flags
            .contains(Flags::EVENT_BATCH_OFFSETS)
        {
            // An old broker would silently start at the tail.
            return Err(ClientError::Unsupported(
                "resuming a subscription from an offset",
            ));
        }
        let (mut s, _) = open_stream(&self.inner.conn, &self.inner.config, self.inner.addr).await?;
        let m = Message::Subscribe {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            subscription_id: None,
            start,
            shard: (shard != 0).then_some(ShardId(shard)),
            queue_capacity: None,
        };
        s.send
            .write_all(&m.to_frame())
            .await
            .map_err(|e| ClientError::connection(self.inner.addr, e))?;
        let _ = s.send.finish();
        let answer = tokio::time::timeout(
            self.inner.config.request_timeout,
            read_message(&mut s, "subscribe"),
        )
        .await
        .map_err(|_| ClientError::Timeout("subscribe"))??;
        let (id, start_offset, live_offset) = match answer {
            Message::Subscribed {
                subscription_id,
                start_offset,
                live_offset,
                ..
            } => (
                subscription_id.0,
                start_offset.map(|o| o.0),
                live_offset.map(|o| o.0),
            ),
            other => return Err(broker_error("subscribe", other)),
        };
        let (recv, reader) = self.event_stream(id).await?;
        let names = (
            Arc::<str>::from(tenant),
            Arc::<str>::from(namespace),
            Arc::<str>::from(stream),
        );
        let feed = Feed::spawn(self.sub_queue_capacity(), s.recv, |tx, end| {
            read_events(recv, reader, tx, names, end)
        });
        Ok(Subscription {
            feed,
            start_offset,
            live_offset,
        })
    }
}

/// Where the reader of a broker-opened event stream says why the broker ended it.
pub(crate) type EndSlot = Arc<std::sync::Mutex<Option<SubscriptionEnd>>>;

/// What the reader task of a broker-opened event stream hands over, in order (a
/// subscription's events, a cache watch's changes), and why the broker ended it.
#[derive(Debug)]
pub(crate) struct Feed<T> {
    rx: mpsc::Receiver<Result<T, ClientError>>,
    end: EndSlot,
    /// The request's stream, held as long as the feed is.
    _control: quinn::RecvStream,
}

impl<T: Send + 'static> Feed<T> {
    /// Spawns the reader `read` makes from the feed's sender (`capacity` items ahead
    /// of the caller at most: then the reader waits, and QUIC flow control holds the
    /// broker back) and its end slot.
    pub(crate) fn spawn<Fut>(
        capacity: usize,
        control: quinn::RecvStream,
        read: impl FnOnce(mpsc::Sender<Result<T, ClientError>>, EndSlot) -> Fut,
    ) -> Feed<T>
    where
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(capacity);
        let end = EndSlot::default();
        tokio::spawn(read(tx, end.clone()));
        Feed {
            rx,
            end,
            _control: control,
        }
    }

    /// The next item; `Ok(None)` once the reader stopped cleanly. Cancel-safe.
    pub(crate) async fn next(&mut self) -> Result<Option<T>, ClientError> {
        self.rx.recv().await.transpose()
    }

    /// Why the broker ended the stream, once the reader recorded it.
    pub(crate) fn end(&self) -> Option<SubscriptionEnd> {
        self.end.lock().expect("end lock").clone()
    }
}

/// The end a `shard_moved` message says, recorded in `end` before the reader returns
/// (and with it the feed's sender), so a caller that saw the end also sees why.
pub(crate) fn record_moved(end: &EndSlot, m: Message) {
    if let Message::ShardMoved {
        resume_from,
        node_id,
        addr,
        generation,
        ..
    } = m
    {
        *end.lock().expect("end lock") = Some(SubscriptionEnd::Moved {
            resume_from: resume_from.map(|o| o.0),
            node_id,
            addr,
            generation: generation.0,
        });
    }
}

impl Client {
    /// Opens a stream for one request and authenticates it.
    pub(crate) async fn open_request_stream(&self) -> Result<Stream, ClientError> {
        open_stream(&self.inner.conn, &self.inner.config, self.inner.addr)
            .await
            .map(|(s, _)| s)
    }

    /// The request timeout this client was configured with.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.inner.config.request_timeout
    }

    /// Events a subscription or watch holds in memory before the broker is held back.
    pub(crate) fn sub_queue_capacity(&self) -> usize {
        self.inner.config.client_sub_queue_capacity.max(1)
    }

    /// The event stream the broker opened (or will open, within the request timeout)
    /// for subscription or watch `id`.
    pub(crate) async fn event_stream(
        &self,
        id: u64,
    ) -> Result<(quinn::RecvStream, FrameReader), ClientError> {
        let events = {
            let mut r = self.inner.router.lock().expect("router lock");
            match r.early.remove(&id) {
                Some(found) => Ok(found),
                None => {
                    let (tx, rx) = oneshot::channel();
                    r.waiting.insert(id, tx);
                    Err(rx)
                }
            }
        };
        match events {
            Ok(found) => Ok(found),
            Err(rx) => tokio::time::timeout(self.inner.config.request_timeout, rx)
                .await
                .map_err(|_| {
                    // The stream may still come: with no waiter it is dropped then.
                    self.inner
                        .router
                        .lock()
                        .expect("router lock")
                        .waiting
                        .remove(&id);
                    ClientError::Timeout("event stream")
                })?
                .map_err(|_| {
                    ClientError::connection(
                        self.inner.addr,
                        "connection closed before the event stream opened",
                    )
                }),
        }
    }
}

/// Why the broker ended a subscription cleanly (its last message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubscriptionEnd {
    /// The shard moved to another broker (`shard_moved`): resume there.
    Moved {
        /// The first offset this subscription did not deliver, when the broker knew it.
        resume_from: Option<u64>,
        /// The new owner.
        node_id: Option<String>,
        /// The new owner's client address, when it publishes one.
        addr: Option<String>,
        /// The assignment generation that moved the shard.
        generation: u64,
    },
    /// The stream was deleted.
    StreamDeleted,
}

/// One shard's subscription.
#[derive(Debug)]
pub struct Subscription {
    feed: Feed<Event>,
    start_offset: Option<u64>,
    live_offset: Option<u64>,
}

impl Subscription {
    /// The next event; `Ok(None)` when the broker ended the subscription cleanly, an
    /// error when the connection was lost. Cancel-safe.
    pub async fn next_event(&mut self) -> Result<Option<Event>, ClientError> {
        self.feed.next().await
    }

    /// Why the broker ended the subscription, once [`Subscription::next_event`] has
    /// returned `Ok(None)` after the broker's last message (`None` before that, or when
    /// it ended without saying why).
    pub fn end(&self) -> Option<SubscriptionEnd> {
        self.feed.end()
    }

    /// The first offset delivered (when a start was given).
    pub fn start_offset(&self) -> Option<u64> {
        self.start_offset
    }

    /// Where live delivery began.
    pub fn live_offset(&self) -> Option<u64> {
        self.live_offset
    }
}

/// A batch of `n` events from `base` names offsets that exist: the reader's task
/// panicked (debug builds) on one running past `u64::MAX`, and its subscriber saw a
/// clean end.
fn offsets_fit(base: Option<felix_wire::Offset>, n: usize) -> Result<(), ClientError> {
    match base {
        Some(o) if o.0.checked_add((n as u64).saturating_sub(1)).is_none() => {
            Err(ClientError::Protocol(format!(
                "an event batch of {n} from offset {} runs past the last offset",
                o.0
            )))
        }
        _ => Ok(()),
    }
}

async fn read_events(
    mut recv: quinn::RecvStream,
    mut reader: FrameReader,
    tx: mpsc::Sender<Result<Event, ClientError>>,
    (t, ns, s): (Arc<str>, Arc<str>, Arc<str>),
    end: EndSlot,
) {
    loop {
        // A dropped subscription ends here at once, not at its next event: dropping the
        // event stream tells the broker to stop, and lets the connection close once
        // nothing else holds it.
        let read = tokio::select! {
            read = read_frame(&mut recv, &mut reader) => read,
            () = tx.closed() => return,
        };
        let frame = match read {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                let _ = tx
                    .send(Err(ClientError::SubscriptionLost(e.to_string())))
                    .await;
                return;
            }
        };
        let mut events = Vec::new();
        match frame.kind {
            FrameKind::EventBatch => match EventBatch::decode(frame.flags, &frame.payload) {
                Ok(b) => {
                    if let Err(e) = offsets_fit(b.base_offset, b.events.len()) {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                    let skipped = b.skipped_before.unwrap_or(0);
                    for (i, e) in b.events.into_iter().enumerate() {
                        events.push(Event {
                            tenant_id: t.clone(),
                            namespace: ns.clone(),
                            stream: s.clone(),
                            payload: e.payload,
                            offset: b.base_offset.map(|o| o.0 + i as u64),
                            skipped_before: if i == 0 { skipped } else { 0 },
                        });
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(ClientError::Protocol(e.to_string()))).await;
                    return;
                }
            },
            FrameKind::Json => match Message::decode(&frame.payload) {
                Ok(Message::Event {
                    payload, offset, ..
                }) => events.push(Event {
                    tenant_id: t.clone(),
                    namespace: ns.clone(),
                    stream: s.clone(),
                    payload,
                    offset: offset.map(|o| o.0),
                    skipped_before: 0,
                }),
                Ok(Message::EventBatch {
                    payloads,
                    base_offset,
                    ..
                }) => {
                    if let Err(e) = offsets_fit(base_offset, payloads.len()) {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                    for (i, p) in payloads.into_iter().enumerate() {
                        events.push(Event {
                            tenant_id: t.clone(),
                            namespace: ns.clone(),
                            stream: s.clone(),
                            payload: p,
                            offset: base_offset.map(|o| o.0 + i as u64),
                            skipped_before: 0,
                        });
                    }
                }
                Ok(Message::SubscriptionLagged { resume_from, .. }) => {
                    let _ = tx
                        .send(Err(ClientError::SubscriptionLagged {
                            resume_from: resume_from.0,
                        }))
                        .await;
                    return;
                }
                Ok(m @ Message::ShardMoved { .. }) => {
                    record_moved(&end, m);
                    return;
                }
                Ok(Message::StreamDeleted { .. }) => {
                    *end.lock().expect("end lock") = Some(SubscriptionEnd::StreamDeleted);
                    return;
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.send(Err(ClientError::Protocol(e.to_string()))).await;
                    return;
                }
            },
            _ => {
                let _ = tx
                    .send(Err(ClientError::Protocol(
                        "unexpected frame on an event stream".into(),
                    )))
                    .await;
                return;
            }
        }
        for e in events {
            // Waiting here pushes back on the broker through QUIC flow control.
            if tx.send(Ok(e)).await.is_err() {
                return;
            }
        }
    }
}

/// Refuses a batch of more records than a broker takes in one publish (the protocol's
/// bound, which replication ships in one message).
pub(crate) fn check_batch_len(records: usize) -> Result<(), ClientError> {
    let max = felix_wire::internal::MAX_RECORDS_PER_MESSAGE;
    if records > max {
        return Err(ClientError::Config(format!(
            "a batch of {records} records is more than a publish may hold ({max}); nothing \
             was sent"
        )));
    }
    Ok(())
}

/// How a publish stream's acks reader ended.
#[derive(Debug, Default)]
struct AcksEnd {
    /// The broker ended the stream cleanly: it read it to its end.
    clean: bool,
    /// The first refusal of a publish sent without an ack (a bare `error`; the broker
    /// keeps the stream open and goes on with the next publish).
    unacked_refused: Option<ClientError>,
}

async fn read_acks(
    mut recv: quinn::RecvStream,
    mut reader: FrameReader,
    pending: PendingAcks,
    addr: SocketAddr,
) -> AcksEnd {
    let mut ended = AcksEnd::default();
    let end = loop {
        let frame = match read_frame(&mut recv, &mut reader).await {
            Ok(Some(f)) => f,
            Ok(None) => {
                ended.clean = true;
                break ClientError::connection(addr, "publish stream ended");
            }
            Err(e) => break e,
        };
        if let Err(e) = answer_ack(frame, &pending, addr, &mut ended) {
            break e;
        }
    };
    end_waiters(&pending, &end);
    ended
}

/// A place for publish `id`'s ack among `pending`'s, or `None` once their stream's
/// reader has ended (nothing would answer it).
fn register_ack(pending: &PendingAcks, id: u64) -> Option<(oneshot::Receiver<AckAnswer>, AckSlot)> {
    let mut waiters = pending.lock().expect("acks lock");
    if waiters.ended {
        return None;
    }
    let (tx, rx) = oneshot::channel();
    waiters.waiting.insert(id, tx);
    let slot = AckSlot {
        acks: pending.clone(),
        id,
    };
    Some((rx, slot))
}

/// Fails every publish waiting in `pending` with `end`, and refuses later ones.
fn end_waiters(pending: &PendingAcks, end: &ClientError) {
    let mut waiters = pending.lock().expect("acks lock");
    waiters.ended = true;
    for (_, tx) in waiters.waiting.drain() {
        let _ = tx.send(Err(end.clone()));
    }
}

/// Hands one ack (or refusal) read from a publish stream to the publish waiting for
/// it. An error ends the stream's reading (every publish still waiting gets it).
fn answer_ack(
    frame: felix_wire::Frame,
    pending: &PendingAcks,
    addr: SocketAddr,
    ended: &mut AcksEnd,
) -> Result<(), ClientError> {
    let (id, result) = match frame.kind {
        FrameKind::PublishAck => match PublishAck::decode(frame.flags, &frame.payload) {
            Ok(ack) => {
                let r = match ack.status {
                    PublishAckStatus::Ok => Ok(ack.first_offset.map(|o| o.0)),
                    PublishAckStatus::Error => Err(ClientError::Broker(BrokerError {
                        code: ack.code.as_ref().map(|c| c.code.clone()),
                        retry: ack.code.as_ref().map(|c| c.retry),
                        detail: ack.code.as_ref().and_then(|c| c.detail.clone()).map(
                            |(reason, ms)| felix_wire::ErrorDetail {
                                reason: Some(reason),
                                retry_after_ms: (ms > 0).then_some(ms),
                            },
                        ),
                        message: ack.message,
                        context: "publish failed",
                    })),
                };
                (ack.request_id.0, r)
            }
            Err(e) => return Err(ClientError::Protocol(e.to_string())),
        },
        FrameKind::Json => match Message::decode(&frame.payload) {
            Ok(Message::PublishOk { request_id, offset }) => {
                (request_id.0, Ok(offset.map(|o| o.0)))
            }
            Ok(m @ Message::PublishError { .. }) => match m.request_id() {
                Some(id) => (id.0, Err(broker_error("publish failed", m))),
                // One naming no publish answers none of them.
                None => return Ok(()),
            },
            // A publish sent without an ack was refused (it could not be read: the
            // broker goes on with the next one; should it end the stream, the end
            // follows). The publishes waiting for acks are unaffected: failing them
            // reported writes that landed as failed. Told by `flush_publishes`.
            Ok(m @ Message::Error { .. }) => {
                let e = broker_error("publish without an ack", m);
                tracing::warn!(broker = %addr, error = %e, "a publish sent without an ack was refused");
                ended.unacked_refused.get_or_insert(e);
                return Ok(());
            }
            // Not an answer to one of them: what the broker did with the publishes
            // still waiting is unknown (it may have appended them), not refused.
            Ok(m) => {
                return Err(ClientError::Protocol(
                    broker_error("publish stream", m).to_string(),
                ));
            }
            Err(e) => return Err(ClientError::Protocol(e.to_string())),
        },
        _ => {
            return Err(ClientError::Protocol(
                "unexpected frame on a publish stream".into(),
            ));
        }
    };
    if let Some(tx) = pending.lock().expect("acks lock").waiting.remove(&id) {
        let _ = tx.send(result);
    }
    Ok(())
}

/// Hands each event stream the broker opens to the subscribe that asked for it. One
/// that comes before its subscribe waits for it up to `unclaimed_for`, then is dropped
/// (the broker then ends the subscription): its subscribe was given up (cancelled,
/// timed out), and kept, the stream held the subscription on the broker and the
/// connection's receive window for as long as the connection lived.
async fn route_event_streams(
    conn: quinn::Connection,
    router: Arc<std::sync::Mutex<Router>>,
    max_frame: usize,
    unclaimed_for: Duration,
) {
    while let Ok(mut recv) = conn.accept_uni().await {
        let router = router.clone();
        tokio::spawn(async move {
            let mut reader = FrameReader::new(max_frame.min(u32::MAX as usize) as u32);
            let Ok(Some(f)) = read_frame(&mut recv, &mut reader).await else {
                return;
            };
            let Ok(Message::EventStreamHello { subscription_id }) = Message::decode(&f.payload)
            else {
                return;
            };
            {
                let mut r = router.lock().expect("router lock");
                match r.waiting.remove(&subscription_id.0) {
                    // A waiter gone (its subscribe given up) gets nothing: the stream is
                    // dropped here.
                    Some(tx) => {
                        let _ = tx.send((recv, reader));
                        return;
                    }
                    None => {
                        r.early.insert(subscription_id.0, (recv, reader));
                    }
                }
            }
            tokio::time::sleep(unclaimed_for).await;
            let unclaimed = router
                .lock()
                .expect("router lock")
                .early
                .remove(&subscription_id.0);
            drop(unclaimed);
        });
    }
}

/// Opens a stream and authenticates it, within the request timeout: a broker that took
/// the stream but never answered its `auth` (or granted no stream) held the caller for
/// good (the connection stayed alive, so its idle timeout never fired).
async fn open_stream(
    conn: &quinn::Connection,
    config: &ClientConfig,
    addr: SocketAddr,
) -> Result<(Stream, Negotiated), ClientError> {
    tokio::time::timeout(config.request_timeout, open_stream_now(conn, config, addr))
        .await
        .map_err(|_| ClientError::Timeout("opening a stream"))?
}

async fn open_stream_now(
    conn: &quinn::Connection,
    config: &ClientConfig,
    addr: SocketAddr,
) -> Result<(Stream, Negotiated), ClientError> {
    let (mut send, recv) = conn
        .open_bi()
        .await
        .map_err(|e| ClientError::connection(addr, e))?;
    let (lo, hi) = client_features().offer();
    let auth = Message::Auth {
        tenant_id: config.tenant()?.to_owned(),
        token: config.token()?,
        client_flags: Some(CLIENT_FLAGS.bits()),
        client_features: lo,
        client_features_hi: hi,
    };
    send.write_all(&auth.to_frame())
        .await
        .map_err(|e| ClientError::connection(addr, e))?;
    let mut s = Stream {
        send,
        recv,
        reader: FrameReader::new(config.max_frame_bytes.min(u32::MAX as usize) as u32),
    };
    let negotiated = match read_message(&mut s, "auth").await? {
        Message::AuthOk {
            server_flags,
            server_features,
            server_features_hi,
            publish_window,
            ..
        } => {
            let features = Features::from_wire(server_features, server_features_hi)
                .intersection(client_features());
            Negotiated {
                flags: Flags(server_flags).intersection(CLIENT_FLAGS),
                features,
                publish_window: if features.contains(Features::PUBLISH_PIPELINE) {
                    publish_window
                } else {
                    None
                },
            }
        }
        Message::Ok => Negotiated {
            flags: Flags::ORIGINAL_V1,
            features: Features::NONE,
            publish_window: None,
        },
        other => return Err(broker_error("auth rejected", other)),
    };
    Ok((s, negotiated))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch whose offsets would run past the last one is the broker's protocol
    /// error, not a panic of the task that reads events (which its subscriber saw as a
    /// clean end).
    #[test]
    fn an_event_batch_past_the_last_offset_is_a_protocol_error() {
        use felix_wire::Offset;
        assert!(offsets_fit(Some(Offset(u64::MAX - 1)), 2).is_ok());
        assert!(matches!(
            offsets_fit(Some(Offset(u64::MAX)), 2),
            Err(ClientError::Protocol(_))
        ));
        assert!(offsets_fit(Some(Offset(u64::MAX)), 1).is_ok());
        assert!(offsets_fit(None, usize::MAX).is_ok());
    }

    /// A publish without an ack that the broker could not read is refused with an
    /// `error` naming no request, and the broker goes on. The publishes waiting for
    /// acks on the same stream got that error as a protocol failure (`ClusterClient`
    /// then reconnected, and `publish_at_least_once` sent them again: duplicates of
    /// writes that had landed); they take their own acks now, and the refusal is kept
    /// for `flush_publishes`.
    #[tokio::test]
    async fn an_unacked_publishs_refusal_fails_no_acked_publish() {
        let frame = |m: Message| {
            let mut r = FrameReader::new(1 << 20);
            r.push(m.to_frame());
            r.next_frame().unwrap().unwrap()
        };
        let frames = [
            frame(Message::Error {
                message: "a publish batch holds at most 65536 records".into(),
                code: Some(felix_wire::ErrorCode::InvalidRequest),
                retry: None,
                detail: None,
            }),
            frame(Message::PublishOk {
                request_id: RequestId(7),
                offset: Some(felix_wire::Offset(41)),
            }),
        ];
        let pending = PendingAcks::default();
        let (tx, rx) = oneshot::channel();
        pending.lock().unwrap().waiting.insert(7, tx);
        let addr: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let mut ended = AcksEnd::default();
        for f in frames {
            answer_ack(f, &pending, addr, &mut ended).expect("the stream reads on");
        }
        assert_eq!(rx.await.unwrap().unwrap(), Some(41), "its own ack");
        assert!(
            matches!(ended.unacked_refused, Some(ClientError::Broker(_))),
            "{:?}",
            ended.unacked_refused
        );
    }

    /// A publish registering for its ack after its stream's reader ended is refused (it
    /// takes another stream), not left waiting: the reader fails only those waiting
    /// when it ends, and one registered just after waited out its whole timeout.
    #[tokio::test]
    async fn an_ack_place_taken_after_its_streams_reader_ended_is_refused() {
        let pending = PendingAcks::default();
        let (before, _slot) = register_ack(&pending, 1).unwrap();
        end_waiters(&pending, &ClientError::connection("x", "reset"));
        assert!(
            matches!(before.await, Ok(Err(ClientError::Connection { .. }))),
            "the one waiting is failed"
        );
        assert!(register_ack(&pending, 2).is_none(), "one after is refused");
        assert!(pending.lock().unwrap().waiting.is_empty());
    }

    /// A broker's `unsupported` answer is `Unsupported` (nothing ran; not retried), not
    /// a protocol failure taken for a suspect connection and an outcome in doubt.
    #[test]
    fn a_brokers_unsupported_answer_is_unsupported() {
        let e = broker_error(
            "group poll",
            Message::Unsupported {
                request_type: "group_poll".into(),
                extension: None,
                request_id: None,
            },
        );
        assert!(matches!(e, ClientError::Unsupported("group poll")), "{e:?}");
        assert_eq!(
            crate::retry::classify(&e, Duration::ZERO),
            crate::retry::Decision::Fail
        );
    }

    #[test]
    fn a_not_leader_refusal_is_a_redirect_not_a_refusal() {
        let refusal = |reason| Message::PublishRefused {
            request_id: RequestId(1),
            reason,
            message: "m".into(),
        };
        let e = broker_error(
            "publish",
            refusal(PublishRefusalReason::NotLeader {
                node_id: "b".into(),
                addr: Some("127.0.0.1:5000".into()),
            }),
        );
        let ClientError::NotLeader(nl) = e else {
            panic!("{e:?}")
        };
        assert_eq!(
            (nl.node_id.as_str(), nl.addr.as_deref()),
            ("b", Some("127.0.0.1:5000"))
        );
        assert!(matches!(
            broker_error("publish", refusal(PublishRefusalReason::UnknownProducer)),
            ClientError::Refused { .. }
        ));
    }
}
