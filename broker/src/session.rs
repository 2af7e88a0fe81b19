//! One client connection and its streams: the handshake, then requests.
//!
//! Every client-opened stream authenticates itself with `auth` first. A bidirectional
//! stream then carries requests; answers are written in request order by one writer
//! task per stream (acked publishes are pipelined up to the publish window; beyond it
//! the stream is not read, so QUIC flow control pushes back on the client). A
//! unidirectional client stream may carry only publishes and is never answered.
//! Subscriptions get a broker-opened unidirectional stream that starts with
//! `event_stream_hello`.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_core_runtime::quic::{Connection, RecvStream, SendStream};
use felix_core_runtime::task;
use felix_storage_uring::BatchKind;
use felix_wire::binary::OwnerHint;
use felix_wire::flags::FrameKind;
use felix_wire::frame::FrameError;
use felix_wire::message::{self, StartPosition};
use felix_wire::{
    Features, Flags, Frame, FrameReader, Generation, Message, Offset, PublishAck, PublishBatch,
    RequestId, ShardId, SubscriptionId, routing,
};

use crate::auth::{Action, Grant, now_secs};
use crate::catalog::validate_name;
use crate::cluster::{Resolved, Route};
use crate::core::{CacheAnswer, CacheOp, CoreBroker, SubQueue};
use crate::error::BrokerError;
use crate::forward;
use crate::shard::{EventFormat, StreamNames, encode_events, encode_json_events};

/// Frame layouts this broker reads and writes.
pub const SERVER_FLAGS: Flags = Flags(
    0x0001
        | 0x0004
        | 0x0008
        | 0x0010
        | 0x0020
        | 0x0040
        | 0x0080
        | 0x0200
        | 0x0400
        | 0x0800
        | 0x1000,
);

/// Requests this broker serves. Advertise only what is served.
pub const SERVER_FEATURES: Features = Features(
    Features::TOPOLOGY.0
        | Features::CACHE_DELETE.0
        | Features::STREAM_SHARDS.0
        | Features::CACHE_SHARDS.0
        | Features::ERROR_CODES.0
        | Features::UNSUPPORTED.0
        | Features::PUBLISH_PIPELINE.0
        | Features::STREAM_PUBLISH_WINDOW.0,
);

/// What a broker following a control plane serves on top: redirects and owners.
pub const CLUSTER_FEATURES: Features =
    Features(SERVER_FEATURES.0 | Features::REDIRECT.0 | Features::SHARD_OWNERS.0);

fn served_features(core: &CoreBroker) -> Features {
    if core.shared.cluster.is_some() {
        CLUSTER_FEATURES
    } else {
        SERVER_FEATURES
    }
}

/// How long an idle subscriber's pump waits before checking for deliveries another
/// core dropped.
const GAP_CHECK: Duration = Duration::from_millis(100);

/// Queued batches a subscriber's pump writes in one go.
const LIVE_WRITE_BATCHES: usize = 64;

/// How long a connection may go without an authenticated stream.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// QUIC application close codes.
const CLOSE_SHUTDOWN: u32 = 0;
const CLOSE_AUTH_TIMEOUT: u32 = 1;

/// What a stream negotiated in its handshake.
#[derive(Debug, Clone)]
struct Session {
    grant: Grant,
    /// The bearer token, for requests forwarded to another broker.
    token: Rc<str>,
    /// Layouts both sides read: what we may send.
    flags: Flags,
    /// Features the client offered that we serve.
    features: Features,
}

impl Session {
    fn coded(&self) -> bool {
        self.features.contains(Features::ERROR_CODES)
    }

    fn check_tenant(&self, tenant: &str) -> Result<(), BrokerError> {
        if tenant != self.grant.tenant {
            return Err(BrokerError::Forbidden(format!(
                "authenticated as tenant {:?}, request names tenant {tenant:?}",
                self.grant.tenant
            )));
        }
        Ok(())
    }

    fn authorize(
        &self,
        action: Action,
        tenant: &str,
        ns: &str,
        name: &str,
    ) -> Result<(), BrokerError> {
        self.check_tenant(tenant)?;
        if self.grant.expires_at + 60 < now_secs() {
            return Err(BrokerError::Unauthenticated("token expired".into()));
        }
        validate_name("namespace", ns)?;
        validate_name(
            if matches!(action, Action::CacheRead | Action::CacheWrite) {
                "cache"
            } else {
                "stream"
            },
            name,
        )?;
        if !self.grant.allows(action, ns, name) {
            return Err(BrokerError::Forbidden(format!(
                "token lacks {action:?} on {tenant}/{ns}/{name}"
            )));
        }
        Ok(())
    }
}

/// Serves one accepted connection until it closes.
pub async fn serve_connection(core: Rc<CoreBroker>, conn: Connection) {
    core.metrics.connections.fetch_add(1, Ordering::Relaxed);
    let authenticated = Rc::new(Cell::new(false));
    let watchdog = {
        let (conn, authenticated) = (conn.clone(), authenticated.clone());
        task::spawn(async move {
            task::sleep(AUTH_TIMEOUT).await;
            if !authenticated.get() {
                conn.close(CLOSE_AUTH_TIMEOUT, b"authentication timeout");
            }
        })
    };
    loop {
        let next = futures_lite::future::or(
            async { conn.accept_bi().await.map(|(s, r)| (Some(s), r)) },
            async { conn.accept_uni().await.map(|r| (None, r)) },
        )
        .await;
        let Ok((send, recv)) = next else { break };
        let (core, authenticated, conn2) = (core.clone(), authenticated.clone(), conn.clone());
        task::spawn(async move {
            serve_stream(core, conn2, send, recv, authenticated).await;
        })
        .detach();
    }
    drop(watchdog);
    core.metrics.connections.fetch_sub(1, Ordering::Relaxed);
}

/// Closes a connection because the broker is shutting down.
pub fn close_for_shutdown(conn: &Connection) {
    conn.close(CLOSE_SHUTDOWN, b"broker shutting down");
}

/// Reads the next whole frame. `Ok(None)` at a clean end of stream.
async fn next_frame(
    recv: &mut RecvStream,
    reader: &mut FrameReader,
) -> Result<Option<Frame>, FrameError> {
    loop {
        if let Some(f) = reader.next_frame()? {
            return Ok(Some(f));
        }
        match recv.read_chunk(256 * 1024).await {
            Ok(Some(chunk)) => reader.push(chunk),
            Ok(None) | Err(_) => return Ok(None),
        }
    }
}

type Pending = Pin<Box<dyn Future<Output = Option<Bytes>>>>;

/// Answers written in request order by one writer task.
struct Outbox {
    queue: RefCell<VecDeque<(Pending, bool)>>,
    writer_waker: RefCell<Option<Waker>>,
    reader_waker: RefCell<Option<Waker>>,
    publishes_in_flight: Cell<u32>,
    closed: Cell<bool>,
    failed: Cell<bool>,
}

impl Outbox {
    fn new() -> Rc<Outbox> {
        Rc::new(Outbox {
            queue: RefCell::default(),
            writer_waker: RefCell::default(),
            reader_waker: RefCell::default(),
            publishes_in_flight: Cell::new(0),
            closed: Cell::new(false),
            failed: Cell::new(false),
        })
    }

    fn push(&self, item: Pending, publish: bool) {
        if publish {
            self.publishes_in_flight
                .set(self.publishes_in_flight.get() + 1);
        }
        self.queue.borrow_mut().push_back((item, publish));
        if let Some(w) = self.writer_waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn push_now(&self, frame: Bytes) {
        self.push(Box::pin(async move { Some(frame) }), false);
    }

    fn close(&self) {
        self.closed.set(true);
        if let Some(w) = self.writer_waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Waits while `window` acked publishes are unanswered.
    async fn wait_window(&self, window: u32) {
        poll_fn(|cx| {
            if self.publishes_in_flight.get() < window || self.failed.get() {
                Poll::Ready(())
            } else {
                *self.reader_waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }

    async fn run(self: Rc<Self>, mut send: SendStream) {
        loop {
            let next = poll_fn(|cx| {
                if let Some(item) = self.queue.borrow_mut().pop_front() {
                    return Poll::Ready(Some(item));
                }
                if self.closed.get() {
                    return Poll::Ready(None);
                }
                *self.writer_waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
            let Some((pending, publish)) = next else {
                break;
            };
            let frame = pending.await;
            if publish {
                self.publishes_in_flight
                    .set(self.publishes_in_flight.get() - 1);
                if let Some(w) = self.reader_waker.borrow_mut().take() {
                    w.wake();
                }
            }
            if let Some(frame) = frame
                && send.write_chunk(frame).await.is_err()
            {
                self.failed.set(true);
                if let Some(w) = self.reader_waker.borrow_mut().take() {
                    w.wake();
                }
                return;
            }
        }
        let _ = send.finish();
    }
}

fn error_frame(e: &BrokerError, session: Option<&Session>) -> Bytes {
    e.to_message(session.is_some_and(Session::coded)).to_frame()
}

async fn serve_stream(
    core: Rc<CoreBroker>,
    conn: Connection,
    send: Option<SendStream>,
    mut recv: RecvStream,
    authenticated: Rc<Cell<bool>>,
) {
    let mut reader = FrameReader::preauth();
    let outbox = Outbox::new();
    let writer = send.map(|s| task::spawn(outbox.clone().run(s)));
    let answers = writer.is_some();
    let session = match handshake(&core, &mut recv, &mut reader).await {
        Ok((session, reply)) => {
            if answers {
                outbox.push_now(reply);
            }
            authenticated.set(true);
            reader.set_max_payload_bytes(core.shared.max_frame_bytes);
            session
        }
        Err(Some(frame)) => {
            if answers {
                outbox.push_now(frame);
            }
            outbox.close();
            if let Some(w) = writer {
                w.await;
            }
            return;
        }
        Err(None) => {
            outbox.close();
            if let Some(w) = writer {
                w.await;
            }
            return;
        }
    };
    let window = core.shared.publish_window.max(1);
    loop {
        if core.draining() {
            break;
        }
        outbox.wait_window(window).await;
        if outbox.failed.get() {
            break;
        }
        let frame = match next_frame(&mut recv, &mut reader).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                let aligned = e.stream_still_aligned();
                if answers {
                    outbox.push_now(error_frame(
                        &BrokerError::InvalidRequest(e.to_string()),
                        Some(&session),
                    ));
                }
                if aligned {
                    continue;
                }
                break;
            }
        };
        let keep_going = if answers {
            handle_frame(&core, &conn, &session, &outbox, frame)
        } else {
            handle_publish_only(&core, &session, frame)
        };
        if !keep_going {
            break;
        }
    }
    outbox.close();
    if let Some(w) = writer {
        w.await;
    }
}

/// Reads and checks `auth`. On success returns the session and the answer frame; on
/// refusal the frame to send before closing (None: nothing to say).
async fn handshake(
    core: &CoreBroker,
    recv: &mut RecvStream,
    reader: &mut FrameReader,
) -> Result<(Session, Bytes), Option<Bytes>> {
    let refuse = |e: BrokerError, coded: bool| Some(e.to_message(coded).to_frame());
    let frame = match next_frame(recv, reader).await {
        Ok(Some(f)) => f,
        Ok(None) => return Err(None),
        Err(e) => return Err(refuse(BrokerError::InvalidRequest(e.to_string()), false)),
    };
    if frame.kind != FrameKind::Json {
        return Err(refuse(
            BrokerError::Unauthenticated("auth required before any other frame".into()),
            false,
        ));
    }
    let Ok(Message::Auth {
        tenant_id,
        token,
        client_flags,
        client_features,
        client_features_hi,
    }) = Message::decode(&frame.payload)
    else {
        return Err(refuse(
            BrokerError::Unauthenticated("the first message must be auth".into()),
            false,
        ));
    };
    let offered = Features::from_wire(client_features, client_features_hi);
    let coded = offered.contains(Features::ERROR_CODES);
    if core.draining() {
        return Err(if coded {
            refuse(BrokerError::Draining, true)
        } else {
            None
        });
    }
    let grant = core
        .shared
        .keys
        .load()
        .verify(&token, &tenant_id, now_secs())
        .map_err(|e| refuse(BrokerError::Unauthenticated(e.to_string()), coded))?;
    let legacy = client_flags.is_none();
    let client_flags = client_flags.map_or(Flags::ORIGINAL_V1, Flags);
    let served = served_features(core);
    let features = offered.intersection(served);
    let reply = if legacy {
        Message::Ok
    } else {
        let (lo, hi) = served.answer(offered);
        Message::AuthOk {
            server_flags: SERVER_FLAGS.bits(),
            server_features: lo,
            server_features_hi: hi,
            listener_ports: None,
            publish_window: features
                .contains(Features::PUBLISH_PIPELINE)
                .then_some(core.shared.publish_window),
        }
    };
    Ok((
        Session {
            grant,
            token: token.into(),
            flags: client_flags.intersection(SERVER_FLAGS),
            features,
        },
        reply.to_frame(),
    ))
}

fn stream_key(
    core: &CoreBroker,
    t: &str,
    ns: &str,
    s: &str,
    key: Option<&[u8]>,
    shard: Option<u32>,
) -> Result<Arc<ShardKey>, BrokerError> {
    let spec = core.catalog.stream(t, ns, s, true)?;
    let shard = match shard {
        Some(n) if n >= spec.shards => {
            return Err(BrokerError::InvalidRequest(format!(
                "shard {n} out of range: {t}/{ns}/{s} has {} shards",
                spec.shards
            )));
        }
        Some(n) => n,
        None => routing::shard_for_key(key, spec.shards, spec.routing).0,
    };
    Ok(Arc::new(ShardKey {
        kind: ShardKind::Stream,
        tenant: t.to_owned(),
        namespace: ns.to_owned(),
        name: s.to_owned(),
        shard,
    }))
}

/// A subscribe for a shard another broker leads: `not_leader` to clients that take
/// redirects, a coded error to the rest.
fn not_leader(session: &Session, route: &Route) -> Bytes {
    if session.features.contains(Features::REDIRECT) {
        Message::NotLeader {
            node_id: route.leader.to_string(),
            addr: route.addr.map(|a| a.to_string()),
            generation: Generation(route.generation),
        }
        .to_frame()
    } else {
        error_frame(
            &BrokerError::NotLeader {
                node_id: route.leader.to_string(),
                addr: route.addr.map(|a| a.to_string()),
            },
            Some(session),
        )
    }
}

/// Who leads each shard of a stream or cache.
fn shard_owners(
    core: &CoreBroker,
    t: &str,
    ns: &str,
    name: &str,
    kind: message::ShardKind,
    request_id: RequestId,
) -> Bytes {
    let kind = match kind {
        message::ShardKind::Stream => ShardKind::Stream,
        message::ShardKind::Cache => ShardKind::Cache,
    };
    let owners = match &core.shared.cluster {
        Some(c) => c
            .routes_of(kind, t, ns, name)
            .into_iter()
            .map(|(shard, r)| message::ShardOwner {
                shard: ShardId(shard),
                node_id: Some(r.leader.to_string()),
                unavailable: r.addr.is_none(),
                addr: r.addr.map(|a| a.to_string()),
                generation: Generation(r.generation),
            })
            .collect(),
        None => Vec::new(),
    };
    Message::ShardOwnersView { owners, request_id }.to_frame()
}

fn cache_key(
    core: &CoreBroker,
    t: &str,
    ns: &str,
    c: &str,
    key: &str,
) -> Result<Arc<ShardKey>, BrokerError> {
    let spec = core.catalog.cache(t, ns, c, true)?;
    Ok(Arc::new(ShardKey {
        kind: ShardKind::Cache,
        tenant: t.to_owned(),
        namespace: ns.to_owned(),
        name: c.to_owned(),
        shard: routing::shard_for_key(Some(key.as_bytes()), spec.shards, spec.routing).0,
    }))
}

fn publish_only_allowed(session: &Session, frame: &Frame) -> Result<PublishBatch, BrokerError> {
    if !SERVER_FLAGS.contains(frame.flags) {
        return Err(BrokerError::InvalidRequest(format!(
            "frame flags {:?} were not advertised by this broker",
            frame.flags
        )));
    }
    let batch = PublishBatch::decode(frame.flags, &frame.payload)
        .map_err(|e| BrokerError::InvalidRequest(e.to_string()))?;
    if batch.payloads.is_empty() {
        return Err(BrokerError::InvalidRequest(
            "a publish batch needs at least one record".into(),
        ));
    }
    session.authorize(
        Action::StreamPublish,
        &batch.tenant,
        &batch.namespace,
        &batch.stream,
    )?;
    Ok(batch)
}

/// A unidirectional client stream: publishes only, never answered; anything else ends
/// the stream.
fn handle_publish_only(core: &Rc<CoreBroker>, session: &Session, frame: Frame) -> bool {
    if frame.kind != FrameKind::PublishBatch {
        return false;
    }
    let Ok(batch) = publish_only_allowed(session, &frame) else {
        core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
        return true;
    };
    let Ok(key) = stream_key(
        core,
        &batch.tenant,
        &batch.namespace,
        &batch.stream,
        batch.key.as_deref(),
        None,
    ) else {
        core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
        return true;
    };
    match core.resolve(&key) {
        Resolved::Local => {
            let fut = append(core, key, batch.payloads);
            task::spawn(async move {
                let _ = fut.await;
            })
            .detach();
        }
        Resolved::Remote(route) => {
            let fut = forward(core, session, &route, forward::reframe(&frame), false);
            task::spawn(async move {
                let _ = fut.await;
            })
            .detach();
        }
        Resolved::Unavailable(_) => {
            core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    true
}

/// Sends a request on to the shard's leader (see [`forward`]).
fn forward(
    core: &Rc<CoreBroker>,
    session: &Session,
    route: &Route,
    request: Bytes,
    answered: bool,
) -> Pin<Box<dyn Future<Output = Result<Option<Frame>, BrokerError>>>> {
    let core = core.clone();
    let (tenant, token) = (session.grant.tenant.clone(), session.token.clone());
    let addr = route.addr;
    core.metrics.forwarded.fetch_add(1, Ordering::Relaxed);
    Box::pin(async move {
        let (Some(f), Some(addr)) = (core.forwarder.as_ref(), addr) else {
            return Err(BrokerError::ShardUnavailable("owner_unavailable".into()));
        };
        f.call(addr, &tenant, &token, request, answered).await
    })
}

/// The owner hint a forwarded ack carries.
fn owner_hint(route: &Route) -> OwnerHint {
    OwnerHint {
        node_id: route.leader.to_string(),
        addr: route.addr.map(|a| a.to_string()),
        generation: Generation(route.generation),
    }
}

/// The leader's answer to a forwarded binary publish, re-encoded for this client with
/// the owner named so it can publish there directly next time.
fn relay_binary_ack(
    session: &Session,
    request_id: RequestId,
    route: &Route,
    answer: Result<Option<Frame>, BrokerError>,
) -> Bytes {
    let mut ack = match answer {
        Ok(Some(f)) if f.kind == FrameKind::PublishAck => {
            match PublishAck::decode(f.flags, &f.payload) {
                Ok(a) => a,
                Err(e) => ack_for(
                    request_id,
                    Err(BrokerError::Internal(format!("leader's ack: {e}"))),
                ),
            }
        }
        Ok(Some(f)) => match Message::decode(&f.payload) {
            Ok(Message::Error { message, code, .. }) => {
                let mut a = PublishAck::error(
                    request_id,
                    message,
                    code.unwrap_or(felix_wire::ErrorCode::Internal),
                );
                a.request_id = request_id;
                a
            }
            _ => ack_for(
                request_id,
                Err(BrokerError::Internal(
                    "unexpected answer from the shard leader".into(),
                )),
            ),
        },
        Ok(None) => ack_for(
            request_id,
            Err(BrokerError::Unacknowledged(
                "no answer from the shard leader".into(),
            )),
        ),
        Err(e) => ack_for(request_id, Err(e)),
    };
    ack.owner = Some(owner_hint(route));
    encode_ack(session, &ack)
}

/// The leader's answer to a forwarded JSON request, passed through; our own error if
/// there was none.
fn relay_json(
    session: &Session,
    answer: Result<Option<Frame>, BrokerError>,
    on_error: impl FnOnce(BrokerError) -> Bytes,
) -> Bytes {
    let _ = session;
    match answer {
        Ok(Some(f)) if f.kind == FrameKind::Json => forward::json_frame(&f.payload),
        Ok(_) => on_error(BrokerError::Internal(
            "unexpected answer from the shard leader".into(),
        )),
        Err(e) => on_error(e),
    }
}

fn append(
    core: &Rc<CoreBroker>,
    key: Arc<ShardKey>,
    records: Vec<Bytes>,
) -> Pin<Box<dyn Future<Output = Result<felix_storage_uring::Appended, BrokerError>>>> {
    let bytes: usize = records.iter().map(Bytes::len).sum();
    core.metrics
        .publish_bytes
        .fetch_add(bytes as u64, Ordering::Relaxed);
    core.append(key, records)
}

fn binary_ack(
    session: &Session,
    request_id: RequestId,
    result: Result<felix_storage_uring::Appended, BrokerError>,
) -> Bytes {
    encode_ack(session, &ack_for(request_id, result))
}

fn ack_for(
    request_id: RequestId,
    result: Result<felix_storage_uring::Appended, BrokerError>,
) -> PublishAck {
    match result {
        Ok(a) => PublishAck::ok(request_id, Some(Offset(a.first))),
        Err(e) => {
            let mut ack = PublishAck::error(request_id, e.to_string(), e.code());
            if let (Some(code), Some(detail)) = (ack.code.as_mut(), e.detail()) {
                code.detail = Some((
                    detail.reason.unwrap_or_default(),
                    detail.retry_after_ms.unwrap_or(0),
                ));
            }
            ack
        }
    }
}

fn encode_ack(session: &Session, ack: &PublishAck) -> Bytes {
    let mut buf = BytesMut::with_capacity(64);
    ack.encode_frame(&mut buf, session.flags)
        .expect("an ack fits a frame");
    buf.freeze()
}

fn json_publish_answer(
    session: &Session,
    request_id: RequestId,
    result: Result<felix_storage_uring::Appended, BrokerError>,
) -> Bytes {
    match result {
        Ok(a) => Message::PublishOk {
            request_id,
            offset: session
                .flags
                .contains(Flags::BINARY_PUBLISH_ACK_OFFSET)
                .then_some(Offset(a.first)),
        },
        Err(e) => {
            let coded = session.coded();
            Message::PublishError {
                request_id,
                message: e.to_string(),
                code: coded.then(|| e.code()),
                retry: coded.then(|| e.code().default_retry()),
                detail: if coded { e.detail() } else { None },
            }
        }
    }
    .to_frame()
}

/// Handles one request on a bidirectional stream. Returns false to end the stream.
fn handle_frame(
    core: &Rc<CoreBroker>,
    conn: &Connection,
    session: &Session,
    outbox: &Rc<Outbox>,
    frame: Frame,
) -> bool {
    match frame.kind {
        FrameKind::PublishBatch => {
            let ack = PublishBatch::decode(frame.flags, &frame.payload)
                .ok()
                .and_then(|b| b.ack);
            match publish_only_allowed(session, &frame).and_then(|b| {
                Ok((
                    stream_key(
                        core,
                        &b.tenant,
                        &b.namespace,
                        &b.stream,
                        b.key.as_deref(),
                        None,
                    )?,
                    b,
                ))
            }) {
                Ok((key, batch)) => match core.resolve(&key) {
                    Resolved::Local => {
                        let fut = append(core, key, batch.payloads);
                        match batch.ack {
                            Some(a) => {
                                let s = session.clone();
                                outbox.push(
                                    Box::pin(async move {
                                        Some(binary_ack(&s, a.request_id, fut.await))
                                    }),
                                    true,
                                );
                            }
                            None => task::spawn(async move {
                                let _ = fut.await;
                            })
                            .detach(),
                        }
                    }
                    Resolved::Remote(route) => {
                        let fut = forward(
                            core,
                            session,
                            &route,
                            forward::reframe(&frame),
                            batch.ack.is_some(),
                        );
                        match batch.ack {
                            Some(a) => {
                                let s = session.clone();
                                outbox.push(
                                    Box::pin(async move {
                                        Some(relay_binary_ack(&s, a.request_id, &route, fut.await))
                                    }),
                                    true,
                                );
                            }
                            None => task::spawn(async move {
                                let _ = fut.await;
                            })
                            .detach(),
                        }
                    }
                    Resolved::Unavailable(reason) => {
                        core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
                        if let Some(a) = batch.ack {
                            outbox.push_now(binary_ack(
                                session,
                                a.request_id,
                                Err(BrokerError::ShardUnavailable(reason.into())),
                            ));
                        }
                    }
                },
                Err(e) => {
                    core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
                    match ack {
                        Some(a) => outbox.push_now(binary_ack(session, a.request_id, Err(e))),
                        None if matches!(e, BrokerError::InvalidRequest(_)) => {
                            outbox.push_now(error_frame(&e, Some(session)))
                        }
                        None => {}
                    }
                }
            }
            true
        }
        FrameKind::Json => match Message::decode(&frame.payload) {
            Ok(m) => handle_message(core, conn, session, outbox, m, &frame.payload),
            Err(e) => {
                outbox.push_now(error_frame(
                    &BrokerError::InvalidRequest(e.to_string()),
                    Some(session),
                ));
                true
            }
        },
        FrameKind::PublishAck | FrameKind::EventBatch => {
            outbox.push_now(error_frame(
                &BrokerError::InvalidRequest("clients do not send acks or event batches".into()),
                Some(session),
            ));
            true
        }
    }
}

fn handle_message(
    core: &Rc<CoreBroker>,
    conn: &Connection,
    session: &Session,
    outbox: &Rc<Outbox>,
    m: Message,
    raw: &[u8],
) -> bool {
    let fail = |outbox: &Outbox, e: BrokerError| outbox.push_now(error_frame(&e, Some(session)));
    match m {
        Message::Publish {
            tenant_id,
            namespace,
            stream,
            payload,
            key,
            shard,
            request_id,
            ack,
        } => json_publish(
            core,
            session,
            outbox,
            raw,
            (tenant_id, namespace, stream),
            vec![payload],
            key,
            shard,
            request_id,
            ack,
        ),
        Message::PublishBatch {
            tenant_id,
            namespace,
            stream,
            payloads,
            key,
            shard,
            request_id,
            ack,
        } => json_publish(
            core,
            session,
            outbox,
            raw,
            (tenant_id, namespace, stream),
            payloads,
            key,
            shard,
            request_id,
            ack,
        ),
        Message::StreamShards {
            tenant_id,
            namespace,
            stream,
            request_id,
        } => {
            let answer = session
                .check_tenant(&tenant_id)
                .and_then(|_| core.catalog.stream(&tenant_id, &namespace, &stream, true));
            match answer {
                Ok(spec) => outbox.push_now(
                    Message::StreamShardsView {
                        shards: spec.shards,
                        request_id,
                        routing: (spec.routing == routing::ShardRouting::JumpHash)
                            .then_some(spec.routing),
                    }
                    .to_frame(),
                ),
                Err(BrokerError::NotFound(_)) => outbox.push_now(
                    Message::StreamShardsView {
                        shards: 0,
                        request_id,
                        routing: None,
                    }
                    .to_frame(),
                ),
                Err(e) => fail(outbox, e),
            }
            true
        }
        Message::CacheShards {
            tenant_id,
            namespace,
            cache,
            request_id,
        } => {
            match session
                .check_tenant(&tenant_id)
                .and_then(|_| core.catalog.cache(&tenant_id, &namespace, &cache, true))
            {
                Ok(spec) => outbox.push_now(
                    Message::CacheShardsView {
                        shards: spec.shards,
                        request_id,
                    }
                    .to_frame(),
                ),
                Err(e) => fail(outbox, e),
            }
            true
        }
        Message::Topology => {
            // A standalone broker has no other broker to offer: an empty answer.
            let brokers = core
                .shared
                .cluster
                .as_ref()
                .map(|c| c.brokers())
                .unwrap_or_default()
                .into_iter()
                .map(|(node_id, addr)| message::BrokerEndpoint { node_id, addr })
                .collect();
            outbox.push_now(Message::TopologyView { brokers }.to_frame());
            true
        }
        Message::Subscribe {
            tenant_id,
            namespace,
            stream,
            subscription_id: _,
            start,
            shard,
            queue_capacity: _,
        } => {
            let r = session
                .authorize(Action::StreamSubscribe, &tenant_id, &namespace, &stream)
                .and_then(|_| {
                    stream_key(
                        core,
                        &tenant_id,
                        &namespace,
                        &stream,
                        None,
                        Some(shard.map_or(0, |s| s.0)),
                    )
                });
            match r.map(|k| (core.resolve(&k), k)) {
                Ok((Resolved::Local, key)) => subscribe(core, conn, session, outbox, key, start),
                Ok((Resolved::Remote(route), _)) => outbox.push_now(not_leader(session, &route)),
                Ok((Resolved::Unavailable(reason), _)) => {
                    fail(outbox, BrokerError::ShardUnavailable(reason.into()))
                }
                Err(e) => fail(outbox, e),
            }
            true
        }
        Message::ShardOwners {
            tenant_id,
            namespace,
            name,
            kind,
            request_id,
        } => {
            match session.check_tenant(&tenant_id) {
                Ok(()) => outbox.push_now(shard_owners(
                    core, &tenant_id, &namespace, &name, kind, request_id,
                )),
                Err(e) => fail(outbox, e),
            }
            true
        }
        Message::CacheGet {
            tenant_id,
            namespace,
            cache,
            key,
            request_id,
        } => {
            cache_request(
                core,
                session,
                outbox,
                raw,
                Action::CacheRead,
                (tenant_id, namespace, cache, key),
                request_id,
                CacheOp::Get,
            );
            true
        }
        Message::CachePut {
            tenant_id,
            namespace,
            cache,
            key,
            value,
            request_id,
            ttl_ms,
        } => {
            cache_request(
                core,
                session,
                outbox,
                raw,
                Action::CacheWrite,
                (tenant_id, namespace, cache, key),
                request_id,
                move |k| CacheOp::Put(k, value, ttl_ms),
            );
            true
        }
        Message::CacheDelete {
            tenant_id,
            namespace,
            cache,
            key,
            request_id,
        } => {
            cache_request(
                core,
                session,
                outbox,
                raw,
                Action::CacheWrite,
                (tenant_id, namespace, cache, key),
                request_id,
                CacheOp::Delete,
            );
            true
        }
        Message::Auth { .. } => {
            fail(
                outbox,
                BrokerError::InvalidRequest("second auth on an authenticated stream".into()),
            );
            true
        }
        _ => {
            // A request we do not serve (unknown type, or one whose feature we did not
            // advertise). Answer `unsupported` only when both sides offered it;
            // otherwise say why and end the stream.
            let summary = message::peek_request(raw);
            if session.features.contains(Features::UNSUPPORTED) {
                outbox.push_now(
                    Message::Unsupported {
                        request_type: summary
                            .as_ref()
                            .map_or_else(|| "unknown".into(), |s| s.request_type.clone()),
                        extension: summary.as_ref().and_then(|s| s.name.clone()),
                        request_id: summary.and_then(|s| s.request_id),
                    }
                    .to_frame(),
                );
                true
            } else {
                fail(
                    outbox,
                    BrokerError::InvalidRequest(format!(
                        "unsupported request {:?}",
                        summary.map(|s| s.request_type).unwrap_or_default()
                    )),
                );
                false
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn json_publish(
    core: &Rc<CoreBroker>,
    session: &Session,
    outbox: &Rc<Outbox>,
    raw: &[u8],
    (t, ns, s): (String, String, String),
    payloads: Vec<Bytes>,
    key: Option<Bytes>,
    shard: Option<ShardId>,
    request_id: Option<RequestId>,
    ack: Option<message::AckMode>,
) -> bool {
    let acked = ack.is_some_and(|a| a != message::AckMode::None);
    let prepared = session
        .authorize(Action::StreamPublish, &t, &ns, &s)
        .and_then(|_| {
            if payloads.is_empty() {
                return Err(BrokerError::InvalidRequest(
                    "a publish batch needs at least one record".into(),
                ));
            }
            if acked && request_id.is_none() {
                return Err(BrokerError::InvalidRequest(
                    "an acked publish needs a request_id".into(),
                ));
            }
            stream_key(core, &t, &ns, &s, key.as_deref(), shard.map(|s| s.0))
        })
        .and_then(|k| match core.resolve(&k) {
            Resolved::Local => Ok(Ok(k)),
            Resolved::Remote(route) => Ok(Err(route)),
            Resolved::Unavailable(reason) => Err(BrokerError::ShardUnavailable(reason.into())),
        });
    let prepared = match prepared {
        Ok(Ok(k)) => Ok(k),
        Ok(Err(route)) => {
            let fut = forward(core, session, &route, forward::json_frame(raw), acked);
            if acked {
                let (s, rid) = (session.clone(), request_id.unwrap_or_default());
                outbox.push(
                    Box::pin(async move {
                        let answer = fut.await;
                        Some(relay_json(&s, answer, |e| {
                            json_publish_answer(&s, rid, Err(e))
                        }))
                    }),
                    true,
                );
            } else {
                task::spawn(async move {
                    let _ = fut.await;
                })
                .detach();
            }
            return true;
        }
        Err(e) => Err(e),
    };
    match (prepared, acked) {
        (Ok(k), true) => {
            let fut = append(core, k, payloads);
            let rid = request_id.unwrap_or_default();
            let s = session.clone();
            outbox.push(
                Box::pin(async move { Some(json_publish_answer(&s, rid, fut.await)) }),
                true,
            );
        }
        (Ok(k), false) => {
            let fut = append(core, k, payloads);
            task::spawn(async move {
                let _ = fut.await;
            })
            .detach();
        }
        (Err(e), true) => outbox.push_now(json_publish_answer(
            session,
            request_id.unwrap_or_default(),
            Err(e),
        )),
        (Err(e), false) => {
            core.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
            if matches!(e, BrokerError::InvalidRequest(_)) {
                outbox.push_now(error_frame(&e, Some(session)));
            }
        }
    }
    true
}

#[allow(clippy::too_many_arguments)]
fn cache_request(
    core: &Rc<CoreBroker>,
    session: &Session,
    outbox: &Rc<Outbox>,
    raw: &[u8],
    action: Action,
    (t, ns, c, key): (String, String, String, String),
    request_id: Option<RequestId>,
    op: impl FnOnce(String) -> CacheOp,
) {
    let shard = session.authorize(action, &t, &ns, &c).and_then(|_| {
        if key.len() > 4096 {
            return Err(BrokerError::InvalidRequest(
                "cache keys are at most 4096 bytes".into(),
            ));
        }
        cache_key(core, &t, &ns, &c, &key)
    });
    let shard = match shard.map(|k| (core.resolve(&k), k)) {
        Ok((Resolved::Local, k)) => k,
        Ok((Resolved::Remote(route), _)) => {
            let fut = forward(core, session, &route, forward::json_frame(raw), true);
            let s = session.clone();
            outbox.push(
                Box::pin(async move {
                    let answer = fut.await;
                    Some(relay_json(&s, answer, |e| {
                        e.to_message(s.coded()).to_frame()
                    }))
                }),
                false,
            );
            return;
        }
        Ok((Resolved::Unavailable(reason), _)) => {
            outbox.push_now(error_frame(
                &BrokerError::ShardUnavailable(reason.into()),
                Some(session),
            ));
            return;
        }
        Err(e) => {
            outbox.push_now(error_frame(&e, Some(session)));
            return;
        }
    };
    let op = op(key.clone());
    let is_put = matches!(op, CacheOp::Put(..));
    let core = core.clone();
    let s = session.clone();
    outbox.push(
        Box::pin(async move {
            let answer = core.cache(shard, op).await;
            Some(
                match answer {
                    Ok(CacheAnswer::Written(_)) if is_put => Message::CacheOk {
                        request_id: request_id.unwrap_or_default(),
                    },
                    Ok(CacheAnswer::Written(_)) => unreachable!("only puts write"),
                    Ok(CacheAnswer::Value(value, _)) => Message::CacheValue {
                        tenant_id: t,
                        namespace: ns,
                        cache: c,
                        key,
                        value,
                        request_id,
                        version: None,
                    },
                    Err(e) => e.to_message(s.coded()),
                }
                .to_frame(),
            )
        }),
        false,
    );
}

fn subscribe(
    core: &Rc<CoreBroker>,
    conn: &Connection,
    session: &Session,
    outbox: &Rc<Outbox>,
    key: Arc<ShardKey>,
    start: Option<StartPosition>,
) {
    let format = EventFormat::for_flags(session.flags);
    let (core, conn, s) = (core.clone(), conn.clone(), session.clone());
    let id = SubscriptionId(next_subscription_id(&core));
    let (answer_tx, answer_rx) = futures_channel::oneshot::channel::<Bytes>();
    outbox.push(Box::pin(async move { answer_rx.await.ok() }), false);
    task::spawn(async move {
        match core.subscribe(key.clone(), start).await {
            Ok((queue, start_offset, live)) => {
                let reply = Message::Subscribed {
                    subscription_id: id,
                    start_offset: Some(Offset(start_offset)),
                    live_offset: Some(Offset(live)),
                    queue_capacity: None,
                };
                let _ = answer_tx.send(reply.to_frame());
                pump(core, conn, key, queue, start_offset, live, id, format).await;
            }
            Err(BrokerError::Cursor {
                reason,
                requested,
                available,
            }) => {
                let _ = answer_tx.send(
                    Message::SubscribeCursorError {
                        reason,
                        requested: Offset(requested),
                        available: Offset(available),
                    }
                    .to_frame(),
                );
            }
            Err(e) => {
                let _ = answer_tx.send(e.to_message(s.coded()).to_frame());
            }
        }
    })
    .detach();
}

fn next_subscription_id(core: &CoreBroker) -> u64 {
    thread_local! {
        static NEXT: Cell<u64> = const { Cell::new(1) };
    }
    let n = NEXT.with(|c| {
        let v = c.get();
        c.set(v + 1);
        v
    });
    ((core.core.index() as u64) << 48) | n
}

/// Writes the committed records `[from, to)` from the log; returns where it stopped
/// (`to`, or earlier if retention already removed the rest).
#[allow(clippy::too_many_arguments)]
async fn replay(
    core: &Rc<CoreBroker>,
    key: &Arc<ShardKey>,
    uni: &mut SendStream,
    names: &StreamNames,
    from: u64,
    to: u64,
    format: EventFormat,
) -> Result<u64, ()> {
    let mut next = from;
    let mut skipped = 0u64;
    while next < to {
        let batches = core
            .read(key.clone(), next, 1 << 20)
            .await
            .map_err(|_| ())?;
        if batches.is_empty() {
            break;
        }
        for b in batches {
            if b.base_offset >= to {
                return Ok(to);
            }
            if b.base_offset + (b.records.len() as u64) <= next {
                continue;
            }
            let skip = next.saturating_sub(b.base_offset) as usize;
            let keep = ((to - b.base_offset) as usize).min(b.records.len());
            if b.kind == BatchKind::GenerationStart {
                skipped += (keep - skip) as u64;
                next = b.base_offset + keep as u64;
                continue;
            }
            let first = b.base_offset + skip as u64;
            let frame = match format {
                EventFormat::Binary => encode_events(
                    first,
                    &b.records[skip..keep],
                    (skipped > 0).then_some(skipped),
                ),
                EventFormat::Json => encode_json_events(names, first, &b.records[skip..keep]),
            };
            skipped = 0;
            uni.write_chunk(frame).await.map_err(|_| ())?;
            next = b.base_offset + keep as u64;
        }
    }
    Ok(next)
}

/// Delivers history from `start` to `live`, then live batches, on a broker-opened
/// unidirectional stream, until the client goes away or the broker stops.
#[allow(clippy::too_many_arguments)]
async fn pump(
    core: Rc<CoreBroker>,
    conn: Connection,
    key: Arc<ShardKey>,
    queue: Rc<SubQueue>,
    start: u64,
    live: u64,
    id: SubscriptionId,
    format: EventFormat,
) {
    let result = async {
        let mut uni = conn.open_uni().await.map_err(|_| ())?;
        uni.write_chunk(
            Message::EventStreamHello {
                subscription_id: id,
            }
            .to_frame(),
        )
        .await
        .map_err(|_| ())?;
        let names = StreamNames {
            tenant: key.tenant.clone(),
            namespace: key.namespace.clone(),
            stream: key.name.clone(),
        };
        // History: never dropped; a slow reader slows the replay.
        let mut next = replay(&core, &key, &mut uni, &names, start, live, format).await?;
        // Live: batches queued after each commit. A queue that overflowed (a reader
        // slower than the writers) shows up as a gap before the next batch; the gap is
        // read back from the log, so a slow subscriber falls behind but loses nothing.
        // Everything queued goes out in one vectored write (frames are shared).
        let mut ready = Vec::with_capacity(LIVE_WRITE_BATCHES);
        let mut frames = Vec::with_capacity(LIVE_WRITE_BATCHES);
        let lost_inbound = || core.metrics.deliveries_lost_inbound.load(Ordering::Relaxed);
        let (mut dropped_seen, mut lost_seen) = (queue.dropped.get(), lost_inbound());
        loop {
            // Batches dropped at the tail leave no later batch to reveal the gap: after
            // any drop — by this queue, or by another core's full outbound queue to this
            // core — read the log up to its end before waiting again. The wait is
            // bounded so a drop by another core is noticed while idle.
            if queue.dropped.get() != dropped_seen || lost_inbound() != lost_seen {
                (dropped_seen, lost_seen) = (queue.dropped.get(), lost_inbound());
                core.metrics
                    .subscriber_catchups
                    .fetch_add(1, Ordering::Relaxed);
                next = replay(&core, &key, &mut uni, &names, next, u64::MAX, format).await?;
            }
            let env = match task::timeout(GAP_CHECK, queue.next()).await {
                Some(Some(env)) => env,
                Some(None) => break,
                None => continue,
            };
            ready.push(env);
            queue.take_ready(LIVE_WRITE_BATCHES - 1, &mut ready);
            for env in ready.drain(..) {
                if env.end() <= next {
                    continue;
                }
                if env.base_offset > next {
                    uni.write_chunks(&mut frames).await.map_err(|_| ())?;
                    frames.clear();
                    core.metrics
                        .subscriber_catchups
                        .fetch_add(1, Ordering::Relaxed);
                    next = replay(&core, &key, &mut uni, &names, next, env.base_offset, format)
                        .await?;
                }
                frames.push(env.frame_from(next, format));
                next = env.end();
            }
            uni.write_chunks(&mut frames).await.map_err(|_| ())?;
            frames.clear();
        }
        let _ = uni.finish();
        Ok::<(), ()>(())
    }
    .await;
    let _ = result;
    core.unsubscribe(key, &queue);
}
