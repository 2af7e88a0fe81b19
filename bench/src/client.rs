//! A minimal wire-level load client (quinn + felix-wire): just enough protocol to drive
//! a broker as hard as the standard SDK would, without the SDK's per-call overhead.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::{Bytes, BytesMut};
use felix_wire::flags::FrameKind;
use felix_wire::{
    AckMode, AckPrefix, EventBatch, Features, FrameReader, Message, PublishAck, PublishAckStatus,
    PublishBatchHeader, RequestId,
};
use tokio::sync::Semaphore;

/// Connection settings.
#[derive(Debug, Clone)]
pub struct Target {
    /// Broker address.
    pub addr: SocketAddr,
    /// CA (PEM).
    pub ca_pem: String,
    /// Tenant.
    pub tenant: String,
    /// Token.
    pub token: String,
}

impl Target {
    /// A connected QUIC connection.
    ///
    /// Connections share a small pool of client endpoints per runtime thread (as one
    /// client process with a few sockets would): fewer sockets than connections keeps
    /// the client's overhead down, and more than one spreads connections over the
    /// broker's cores (its SO_REUSEPORT sockets pick a core by source address).
    pub async fn connect(&self) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
        const POOL: usize = 8;
        thread_local! {
            static ENDPOINTS: std::cell::RefCell<(Vec<quinn::Endpoint>, usize)> = const { std::cell::RefCell::new((Vec::new(), 0)) };
        }
        let roots = felix_core_runtime::quic::certs_from_pem(&self.ca_pem)?;
        let config = felix_core_runtime::quic::client_config(&roots, false, Default::default())?;
        let pooled = ENDPOINTS.with(|e| {
            let mut e = e.borrow_mut();
            let (eps, next) = &mut *e;
            *next += 1;
            (eps.len() == POOL).then(|| eps[*next % POOL].clone())
        });
        let ep = match pooled {
            Some(ep) => ep,
            None => {
                let ep = quinn::Endpoint::client("127.0.0.1:0".parse().expect("valid"))?;
                ENDPOINTS.with(|e| e.borrow_mut().0.push(ep.clone()));
                ep
            }
        };
        let conn = ep.connect_with(config, self.addr, "localhost")?.await?;
        Ok((ep, conn))
    }

    pub(crate) fn auth(&self) -> Bytes {
        Message::Auth {
            tenant_id: self.tenant.clone(),
            token: self.token.clone(),
            client_flags: Some(0x1FFF),
            client_features: Features::ERROR_CODES
                .union(Features::PUBLISH_PIPELINE)
                .offer()
                .0,
            client_features_hi: None,
        }
        .to_frame()
    }
}

async fn next_frame(
    recv: &mut quinn::RecvStream,
    reader: &mut FrameReader,
) -> anyhow::Result<Option<felix_wire::Frame>> {
    loop {
        if let Some(f) = reader.next_frame()? {
            return Ok(Some(f));
        }
        match recv.read_chunk(1 << 20, true).await? {
            Some(c) => reader.push(c.bytes),
            None => return Ok(None),
        }
    }
}

/// An authenticated publish stream with pipelined, acked binary batches.
pub struct Publisher {
    send: quinn::SendStream,
    window: Arc<Semaphore>,
    sent_at: Arc<std::sync::Mutex<VecDeque<Instant>>>,
    acks: tokio::task::JoinHandle<anyhow::Result<Vec<f64>>>,
    next_id: u64,
    buf: BytesMut,
    /// A window slot taken by [`Publisher::reserve`] for the next publish.
    reserved: bool,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("next_id", &self.next_id)
            .finish()
    }
}

impl Publisher {
    /// Opens a stream on `conn`, authenticates, and allows `window` unanswered batches.
    pub async fn open(
        target: &Target,
        conn: &quinn::Connection,
        window: usize,
    ) -> anyhow::Result<Publisher> {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&target.auth()).await?;
        let mut reader = FrameReader::new(1 << 20);
        let f = next_frame(&mut recv, &mut reader)
            .await?
            .context("no auth answer")?;
        match Message::decode(&f.payload)? {
            Message::AuthOk { .. } => {}
            other => bail!("auth refused: {other:?}"),
        }
        let window = Arc::new(Semaphore::new(window));
        let sent_at = Arc::new(std::sync::Mutex::new(VecDeque::<Instant>::new()));
        let (w, s) = (window.clone(), sent_at.clone());
        let acks = tokio::spawn(async move {
            let read = async {
                let mut lat = Vec::new();
                while let Some(f) = next_frame(&mut recv, &mut reader).await? {
                    if f.kind != FrameKind::PublishAck {
                        bail!("unexpected answer {:?}", Message::decode(&f.payload));
                    }
                    let ack = PublishAck::decode(f.flags, &f.payload)?;
                    if ack.status != PublishAckStatus::Ok {
                        bail!("publish failed: {}", ack.message);
                    }
                    if let Some(t) = s.lock().expect("ack times").pop_front() {
                        lat.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    w.add_permits(1);
                }
                Ok(lat)
            };
            let result = read.await;
            // No more acks come: a producer waiting for window room must fail, not
            // wait forever (a refused publish during a live re-pin hung the bench).
            w.close();
            result
        });
        Ok(Publisher {
            send,
            window,
            sent_at,
            acks,
            next_id: 0,
            buf: BytesMut::with_capacity(1 << 20),
            reserved: false,
        })
    }

    /// Waits for window room and keeps it for the next publish, so a closed-loop load
    /// can stamp a batch when it can go rather than before waiting for the previous ack.
    pub async fn reserve(&mut self) -> anyhow::Result<()> {
        if !self.reserved {
            self.take_room().await?;
            self.reserved = true;
        }
        Ok(())
    }

    async fn take_room(&self) -> anyhow::Result<()> {
        if self.window.acquire().await.map(|p| p.forget()).is_err() {
            bail!("no more acks: a publish was refused or the stream closed (finish says which)");
        }
        Ok(())
    }

    /// Sends one acked batch, waiting for window room first.
    pub async fn publish(
        &mut self,
        target: &Target,
        namespace: &str,
        stream: &str,
        payloads: &[Bytes],
    ) -> anyhow::Result<()> {
        self.publish_at(target, namespace, stream, payloads, None)
            .await
    }

    /// Like [`Publisher::publish`], with the ack latency measured from `intended` (the
    /// time an open-loop schedule meant to send it) instead of the actual send.
    pub async fn publish_at(
        &mut self,
        target: &Target,
        namespace: &str,
        stream: &str,
        payloads: &[Bytes],
        intended: Option<Instant>,
    ) -> anyhow::Result<()> {
        if !std::mem::take(&mut self.reserved) {
            self.take_room().await?;
        }
        self.next_id += 1;
        self.buf.clear();
        PublishBatchHeader {
            tenant: &target.tenant,
            namespace,
            stream,
            ack: Some(AckPrefix {
                request_id: RequestId(self.next_id),
                ack_mode: AckMode::PerBatch,
            }),
            idempotent: None,
            key: None,
        }
        .encode_frame(&mut self.buf, payloads)?;
        self.sent_at
            .lock()
            .expect("ack times")
            .push_back(intended.unwrap_or_else(Instant::now));
        self.send.write_all(&self.buf).await?;
        Ok(())
    }

    /// Waits for every ack; returns ack latencies (µs).
    ///
    /// A stream the broker ended before acking every publish is an error: counted as
    /// acked, its publishes would pass for delivered in cells that check no delivery.
    pub async fn finish(mut self) -> anyhow::Result<Vec<f64>> {
        self.send.finish()?;
        // As long as the TCP peers' producers wait for their last acks.
        let lat = tokio::time::timeout(std::time::Duration::from_secs(30), self.acks)
            .await
            .map_err(|_| anyhow::anyhow!("acks still owed after 30 s"))???;
        let owed = self.sent_at.lock().expect("ack times").len();
        if owed > 0 {
            bail!("{owed} publishes never acknowledged (the stream ended first)");
        }
        Ok(lat)
    }
}

/// A subscription's event stream.
pub struct Subscriber {
    events: quinn::RecvStream,
    reader: FrameReader,
    _control: (quinn::SendStream, quinn::RecvStream),
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Subscriber")
    }
}

impl Subscriber {
    /// Subscribes to shard 0 of `stream` from the tail.
    pub async fn open(
        target: &Target,
        conn: &quinn::Connection,
        namespace: &str,
        stream: &str,
    ) -> anyhow::Result<Subscriber> {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&target.auth()).await?;
        send.write_all(
            &Message::Subscribe {
                tenant_id: target.tenant.clone(),
                namespace: namespace.into(),
                stream: stream.into(),
                subscription_id: None,
                start: None,
                shard: None,
                queue_capacity: None,
            }
            .to_frame(),
        )
        .await?;
        let mut reader = FrameReader::new(1 << 20);
        for _ in 0..2 {
            let f = next_frame(&mut recv, &mut reader)
                .await?
                .context("no answer")?;
            match Message::decode(&f.payload)? {
                Message::AuthOk { .. } | Message::Subscribed { .. } => {}
                other => bail!("subscribe refused: {other:?}"),
            }
        }
        let mut events = conn.accept_uni().await?;
        let mut reader = FrameReader::new(16 << 20);
        let hello = next_frame(&mut events, &mut reader)
            .await?
            .context("no hello")?;
        anyhow::ensure!(matches!(
            Message::decode(&hello.payload)?,
            Message::EventStreamHello { .. }
        ));
        Ok(Subscriber {
            events,
            reader,
            _control: (send, recv),
        })
    }

    /// The next batch: (base offset, payloads).
    pub async fn next(&mut self) -> anyhow::Result<Option<(u64, Vec<Bytes>)>> {
        let Some(f) = next_frame(&mut self.events, &mut self.reader).await? else {
            return Ok(None);
        };
        anyhow::ensure!(f.kind == FrameKind::EventBatch, "expected an event batch");
        let b = EventBatch::decode(f.flags, &f.payload)?;
        Ok(Some((
            b.base_offset.map_or(0, |o| o.0),
            b.events.into_iter().map(|e| e.payload).collect(),
        )))
    }
}
