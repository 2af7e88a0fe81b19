//! `ClusterClient`: a `Client` that survives the broker it uses.
//!
//! It connects to the first endpoint that answers, asks that broker which others a
//! client may use (discovery only ever adds: configured seeds are never removed), and
//! when the broker in use fails, rebuilds its `Client` from the endpoints under the
//! [`ReconnectPolicy`]. Only one rebuild runs at a time; concurrent callers wait for it,
//! and take its failure if it failed.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use felix_wire::AckMode;
use felix_wire::message::StartPosition;
use rand::{RngExt, SeedableRng};
use tokio::time::Instant;

use crate::client::{Client, Subscription};
use crate::config::ClientConfig;
use crate::error::ClientError;
use crate::retry::{Decision, ReconnectPolicy, classify};

/// Redirect hops followed for one subscribe.
pub const MAX_REDIRECTS: usize = 3;

/// A client of a cluster of brokers.
pub struct ClusterClient {
    seeds: Vec<SocketAddr>,
    server_name: String,
    config: ClientConfig,
    policy: ReconnectPolicy,
    current: RwLock<(Arc<Client>, u64)>,
    discovered: RwLock<Vec<SocketAddr>>,
    rebuild: Rebuild,
    rng: Mutex<rand::rngs::StdRng>,
    /// Clients of the brokers `not_leader` answers named, kept for the next call.
    owners: Mutex<std::collections::HashMap<SocketAddr, Arc<Client>>>,
    /// Replaced clients that may still owe the next flush (owing, or held by a call),
    /// background flushes of older ones, and the first loss those found:
    /// [`ClusterClient::flush_publishes`] flushes and waits for them, and reports it.
    replaced: Mutex<Replaced>,
}

/// What the clients a [`ClusterClient`] replaced owe its next flush.
#[derive(Default)]
struct Replaced {
    /// The newest replaced clients that may still owe one: a call that took one before
    /// it was replaced may still publish on it.
    kept: Vec<Arc<Client>>,
    /// Flushes of older ones, still running (those finished are let go at the next
    /// replacement).
    flushes: Vec<tokio::task::JoinHandle<()>>,
    /// The first loss a flush of an older one found.
    lost: Arc<Mutex<Option<ClientError>>>,
}

/// Replaced clients kept for the next flush; past these, the oldest is flushed at once,
/// in the background.
const REPLACED_KEPT: usize = 8;

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("seeds", &self.seeds)
            .field("policy", &self.policy)
            .finish()
    }
}

impl ClusterClient {
    /// Connects with the default policy.
    pub async fn connect(
        seeds: &[SocketAddr],
        server_name: &str,
        config: ClientConfig,
    ) -> Result<ClusterClient, ClientError> {
        Self::connect_with_policy(seeds, server_name, config, ReconnectPolicy::default()).await
    }

    /// Connects to the first seed that answers, retrying under `policy`, then discovers
    /// the other brokers.
    pub async fn connect_with_policy(
        seeds: &[SocketAddr],
        server_name: &str,
        config: ClientConfig,
        policy: ReconnectPolicy,
    ) -> Result<ClusterClient, ClientError> {
        if seeds.is_empty() {
            return Err(ClientError::Config(
                "at least one broker address is required".into(),
            ));
        }
        config.tenant()?;
        let seeds = seeds.to_vec();
        // Seeded before the await: the thread's generator must not live across it, or
        // the future is not `Send` and cannot run on a multi-threaded runtime.
        let rng = Mutex::new(rand::rngs::StdRng::from_rng(&mut rand::rng()));
        let client = establish(&seeds, server_name, &config, &policy, &rng).await?;
        let cc = ClusterClient {
            seeds,
            server_name: server_name.to_owned(),
            config,
            policy,
            current: RwLock::new((Arc::new(client), 0)),
            discovered: RwLock::new(Vec::new()),
            rebuild: Rebuild::default(),
            rng,
            owners: Mutex::default(),
            replaced: Mutex::default(),
        };
        let _ = cc.refresh_topology().await;
        Ok(cc)
    }

    /// Everywhere this client would try: discovered brokers and every seed.
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for a in self
            .discovered
            .read()
            .expect("discovered lock")
            .iter()
            .chain(&self.seeds)
        {
            if seen.insert(*a) {
                out.push(*a);
            }
        }
        out
    }

    /// Asks the broker in use which brokers a client may use; returns how many it named.
    /// Discovered brokers that are no longer named are dropped; seeds never are.
    pub async fn refresh_topology(&self) -> Result<usize, ClientError> {
        let brokers = self.client().topology().await?;
        let addrs: Vec<SocketAddr> = brokers.iter().filter_map(|b| b.addr.parse().ok()).collect();
        *self.discovered.write().expect("discovered lock") = addrs;
        Ok(brokers.len())
    }

    /// The `Client` in use.
    pub fn client(&self) -> Arc<Client> {
        self.current.read().expect("current lock").0.clone()
    }

    fn generation(&self) -> u64 {
        self.current.read().expect("current lock").1
    }

    /// Replaces the `Client` in use, unless someone already did since `seen`, under the
    /// policy. A caller that waited while another's rebuild failed takes that failure
    /// rather than running the whole policy of connects again at once (callers queued
    /// behind a failed rebuild each ran theirs in turn: minutes with the seeds down).
    async fn reconnect(&self, seen: u64) -> Result<(), ClientError> {
        self.reconnect_under(seen, &self.policy).await
    }

    /// [`ClusterClient::reconnect`], connecting under `policy`.
    async fn reconnect_under(
        &self,
        seen: u64,
        policy: &ReconnectPolicy,
    ) -> Result<(), ClientError> {
        let installed = self
            .rebuild
            .run(
                || self.generation() == seen,
                || async move {
                    establish(
                        &self.endpoints(),
                        &self.server_name,
                        &self.config,
                        policy,
                        &self.rng,
                    )
                    .await
                },
                // Under the rebuild's lock: a caller waiting for it must see the new
                // generation, or it would connect a second time.
                |client| {
                    let mut cur = self.current.write().expect("current lock");
                    let old = std::mem::replace(&mut *cur, (Arc::new(client), seen + 1)).0;
                    drop(cur);
                    self.keep_replaced(old);
                },
            )
            .await?;
        if installed.is_some() {
            let _ = self.refresh_topology().await;
        }
        Ok(())
    }

    /// Keeps a replaced client for [`ClusterClient::flush_publishes`]: replaced in
    /// silence, the losses of the publishes owed no ack it had sent went with it, and a
    /// flush of the client in use answered `Ok` (until 2026-12-08). Kept as a client,
    /// not flushed at once: a call that took it before it was replaced may publish on
    /// it still. Past [`REPLACED_KEPT`], the oldest is flushed in the background.
    fn keep_replaced(&self, old: Arc<Client>) {
        let mut replaced = self.replaced.lock().expect("replaced lock");
        replaced.flushes.retain(|f| !f.is_finished());
        // One that owes nothing is kept only while a call still holds it (it may
        // publish on it yet): kept otherwise, its connection stayed open, up to eight
        // of them, against the broker's connection bounds.
        let held = |c: &Arc<Client>| c.owes_unacked() || Arc::strong_count(c) > 1;
        replaced.kept.retain(held);
        if held(&old) {
            replaced.kept.push(old);
        }
        while replaced.kept.len() > REPLACED_KEPT {
            let oldest = replaced.kept.remove(0);
            let lost = replaced.lost.clone();
            replaced.flushes.push(tokio::spawn(async move {
                if let Err(e) = oldest.flush_publishes().await {
                    lost.lock().expect("lost lock").get_or_insert(e);
                }
            }));
        }
    }

    /// Waits until every publish sent owed no ack has been read by a broker, on the
    /// client in use ([`Client::flush_publishes`]) and on the clients it replaced since
    /// the last flush (a lost connection, a failover, a timeout); the first loss found
    /// is the error. Use this, not `client().flush_publishes()`, with a
    /// `ClusterClient`.
    pub async fn flush_publishes(&self) -> Result<(), ClientError> {
        let (kept, flushes, lost) = {
            let mut replaced = self.replaced.lock().expect("replaced lock");
            (
                std::mem::take(&mut replaced.kept),
                std::mem::take(&mut replaced.flushes),
                replaced.lost.clone(),
            )
        };
        // Together: each may wait out a request timeout. One owing nothing that a call
        // still holds is kept for the next flush: that call may publish on it yet.
        let (owing, held): (Vec<_>, Vec<_>) = kept.into_iter().partition(|c| c.owes_unacked());
        let held: Vec<_> = held
            .into_iter()
            .filter(|c| Arc::strong_count(c) > 1)
            .collect();
        let mut first = crate::sharded::futures_join_all(
            owing
                .into_iter()
                .map(|c| async move { c.flush_publishes().await.err() }),
        )
        .await
        .into_iter()
        .flatten()
        .next();
        self.replaced
            .lock()
            .expect("replaced lock")
            .kept
            .extend(held);
        for f in flushes {
            if let Err(e) = f.await {
                first.get_or_insert(ClientError::Protocol(format!(
                    "flushing a replaced connection: {e}"
                )));
            }
        }
        let earlier = lost.lock().expect("lost lock").take();
        let now = self.client().flush_publishes().await;
        match earlier.or(first) {
            Some(e) => Err(e),
            None => now,
        }
    }

    /// Replaces the `Client` in use if its connection has closed (whatever the broker
    /// serves: a reconnect forced through a request fails before sending on a broker
    /// that does not serve that request); the reconnect's failure, if it failed.
    pub(crate) async fn replace_if_closed(&self) -> Result<(), ClientError> {
        let seen = self.generation();
        if self.client().is_closed() {
            return self.reconnect(seen).await;
        }
        Ok(())
    }

    /// After a one-shot call's result `r` on generation `seen`: a lost connection is
    /// replaced in one round over the endpoints.
    async fn replace_after<T>(&self, seen: u64, r: &Result<T, ClientError>) {
        if let Err(e) = r
            && classify(e, Duration::ZERO) == Decision::Reconnect
        {
            let _ = self.reconnect_under(seen, &self.policy.one_round()).await;
        }
    }

    /// A random number in `[0, 1)`.
    pub(crate) fn unit(&self) -> f64 {
        self.rng.lock().expect("rng lock").random()
    }

    fn jitter(&self, attempt: usize) -> Duration {
        self.policy.delay(attempt, self.unit())
    }

    /// Publishes once. On a connection failure the connection is replaced before the
    /// error returns, in one round over the endpoints (a one-shot call does not wait out
    /// the whole policy with the cluster down), so the next call goes somewhere live;
    /// the record is not resent (it may have landed).
    pub async fn publish(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        payload: Vec<u8>,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        let seen = self.generation();
        let r = self
            .client()
            .publish(tenant, namespace, stream, payload, ack)
            .await;
        self.replace_after(seen, &r).await;
        r
    }

    /// Publishes under a routing key, once (see [`ClusterClient::publish`]).
    pub async fn publish_keyed(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        payload: Vec<u8>,
        key: Bytes,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        let seen = self.generation();
        let r = self
            .client()
            .publish_keyed(tenant, namespace, stream, key, payload, ack)
            .await;
        self.replace_after(seen, &r).await;
        r
    }

    /// Publishes, reconnecting and resending until acknowledged or the policy gives
    /// up. May deliver the record twice: only the application can tell duplicates.
    pub async fn publish_at_least_once(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        payload: Vec<u8>,
        ack: AckMode,
    ) -> Result<Option<u64>, ClientError> {
        self.with_retry(Resend::Always, |c| {
            let payload = payload.clone();
            async move { c.publish(tenant, namespace, stream, payload, ack).await }
        })
        .await
    }

    /// Runs `op` on the client in use, retrying by the error's class under the policy,
    /// sending it again only after the failures `resend` allows.
    pub(crate) async fn with_retry<T, F, Fut>(
        &self,
        resend: Resend<'_>,
        op: F,
    ) -> Result<T, ClientError>
    where
        F: Fn(Arc<Client>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        // The generation the failing attempt ran on: a reconnect replaces only that,
        // in one round over the endpoints (this loop backs off and counts attempts).
        let seen = AtomicU64::new(0);
        let round = self.policy.one_round();
        retry_under(
            &self.policy,
            resend,
            self.endpoints().len(),
            |attempt| self.jitter(attempt),
            || {
                seen.store(self.generation(), Ordering::Relaxed);
                op(self.client())
            },
            || self.reconnect_under(seen.load(Ordering::Relaxed), &round),
        )
        .await
    }

    /// Subscribes to one shard from `start`: follows `not_leader` redirects and retries
    /// refusals of the retry classes (`not_ready` while a promoted leader fences, a
    /// shard moving or not yet assigned) under the policy, as the protocol asks of
    /// opening a shard; a fatal refusal returns at once.
    pub async fn subscribe_shard(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        start: Option<StartPosition>,
    ) -> Result<Subscription, ClientError> {
        self.with_retry(Resend::NotUnknown, |_| {
            self.subscribe_shard_once(tenant, namespace, stream, shard, start)
        })
        .await
    }

    /// One attempt at [`ClusterClient::subscribe_shard`]: follows `not_leader`
    /// redirects up to [`MAX_REDIRECTS`] hops, never revisiting a broker, and retries
    /// nothing else.
    pub(crate) async fn subscribe_shard_once(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        start: Option<StartPosition>,
    ) -> Result<Subscription, ClientError> {
        self.on_owner(|c| async move {
            c.subscribe_shard(tenant, namespace, stream, shard, start)
                .await
        })
        .await
        .map(|(_, sub)| sub)
    }

    /// Runs `op` on the broker that owns what it names: the client in use first, then
    /// each broker a `not_leader` answer names, up to [`MAX_REDIRECTS`] hops, never
    /// revisiting one. Answers the client that answered, with the answer: a group's
    /// requests, which only the shard's owner serves, go on there. Clients of the
    /// brokers named are kept for the next call. Retries nothing else.
    pub async fn on_owner<T, F, Fut>(&self, op: F) -> Result<(Arc<Client>, T), ClientError>
    where
        F: Fn(Arc<Client>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let mut client = self.client();
        let mut visited = vec![client.addr()];
        for _ in 0..=MAX_REDIRECTS {
            match op(client.clone()).await {
                Err(ClientError::NotLeader(nl)) => {
                    let addr: SocketAddr = nl
                        .addr
                        .as_deref()
                        .and_then(|a| a.parse().ok())
                        .ok_or_else(|| ClientError::NotLeader(nl.clone()))?;
                    if visited.contains(&addr) {
                        return Err(ClientError::Protocol(format!("redirected back to {addr}")));
                    }
                    visited.push(addr);
                    client = self.owner_at(addr).await?;
                }
                Ok(v) => return Ok((client, v)),
                Err(e) => return Err(e),
            }
        }
        Err(ClientError::Protocol(format!(
            "more than {MAX_REDIRECTS} redirects"
        )))
    }

    /// A client of the broker at `addr`: the one kept from an earlier redirect while
    /// its connection lives, or a new one.
    async fn owner_at(&self, addr: SocketAddr) -> Result<Arc<Client>, ClientError> {
        if let Some(c) = self
            .owners
            .lock()
            .expect("owners lock")
            .get(&addr)
            .filter(|c| !c.is_closed())
        {
            return Ok(c.clone());
        }
        // Connected without the lock: a broker that does not answer (a stale redirect
        // during a failover) holds up only the calls sent to it.
        let c = Arc::new(Client::connect(addr, &self.server_name, self.config.clone()).await?);
        self.owners
            .lock()
            .expect("owners lock")
            .insert(addr, c.clone());
        Ok(c)
    }

    /// Subscribes to shard 0 from `start`, with retries.
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

    /// Shard count of a stream, with retries.
    pub async fn stream_shards(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<u32, ClientError> {
        self.with_retry(Resend::NotUnknown, |c| async move {
            c.stream_shards(tenant, namespace, stream).await
        })
        .await
    }

    /// Sets a cache key (retried: a put is idempotent).
    pub async fn cache_put(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
    ) -> Result<(), ClientError> {
        self.with_retry(Resend::Always, |c| {
            let value = value.clone();
            async move {
                c.cache_put(tenant, namespace, cache, key, value, ttl_ms)
                    .await
            }
        })
        .await
    }

    /// Reads a cache key.
    pub async fn cache_get(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<Bytes>, ClientError> {
        self.with_retry(Resend::Always, |c| async move {
            c.cache_get(tenant, namespace, cache, key).await
        })
        .await
    }

    /// Adds a signed delta to a counter beside the cache and returns the sum including
    /// it. Not resent when the broker says the outcome is unknown; resent after a lost
    /// connection, a timeout or a protocol error, so, as [`Client::counter_add`],
    /// at-least-once: an add whose answer was lost that way may count twice.
    pub async fn counter_add(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
        delta: i64,
    ) -> Result<i64, ClientError> {
        self.with_retry(Resend::NotUnknown, |c| async move {
            c.counter_add(tenant, namespace, cache, key, delta).await
        })
        .await
    }

    /// Reads a counter: `None` when never written (which is not zero).
    pub async fn counter_get(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<i64>, ClientError> {
        self.with_retry(Resend::Always, |c| async move {
            c.counter_get(tenant, namespace, cache, key).await
        })
        .await
    }

    /// Appends `event` and applies `changes` to the entity's state, all or nothing;
    /// returns the offset (every key's new version). With `expected_offset` it is resent
    /// after a lost connection, a timeout or a protocol error, since a resend of one
    /// that applied is refused (`offset_mismatch`) rather than applied twice (so that
    /// refusal does not say the commit did not apply). Without, a resend could append
    /// the event twice: after any failure that may have followed the send it gives up
    /// `in_doubt` instead. An attempt on a connection closed already sends nothing: it
    /// is retried after a reconnect, as any other (a connection lost while the commit
    /// was sent leaves it in doubt, whether or not the broker read it).
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
        let sent = AtomicBool::new(false);
        let resend = if expected_offset.is_some() {
            Resend::NotUnknown
        } else {
            Resend::Never { sent: &sent }
        };
        let sent = &sent;
        self.with_retry(resend, |c| {
            let (event, changes) = (event.clone(), changes.clone());
            async move {
                // A connection closed already sends nothing: retried, not in doubt.
                let closed = c.is_closed();
                sent.store(!closed, Ordering::Relaxed);
                if closed {
                    return Err(ClientError::connection(
                        "the broker in use",
                        "the connection closed before the commit was sent",
                    ));
                }
                c.commit(
                    tenant,
                    namespace,
                    stream,
                    entity_key,
                    event,
                    changes,
                    expected_offset,
                )
                .await
            }
        })
        .await
    }

    /// Reads a state key of an entity: its value and version, and the offset the read
    /// is as of.
    pub async fn state_get(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        entity_key: &str,
        key: &str,
    ) -> Result<(Option<(Bytes, u64)>, Option<u64>), ClientError> {
        self.with_retry(Resend::Always, |c| async move {
            c.state_get(tenant, namespace, stream, entity_key, key)
                .await
        })
        .await
    }

    /// Removes a cache key; returns the value it had. The removal is resent after a
    /// lost connection (removing twice leaves the key as removing once), but the value
    /// returned is then the resend's: none, if the first attempt removed it and its
    /// answer was lost.
    pub async fn cache_delete(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<Option<Bytes>, ClientError> {
        self.with_retry(Resend::NotUnknown, |c| async move {
            c.cache_delete(tenant, namespace, cache, key).await
        })
        .await
    }
}

/// One rebuild of a connection at a time, and callers that waited for a failed one take
/// its failure.
#[derive(Debug, Default)]
pub(crate) struct Rebuild {
    one: tokio::sync::Mutex<()>,
    /// Rebuilds that failed so far.
    failed: AtomicU64,
}

impl Rebuild {
    /// Runs `pass` alone and hands what it made to `install`, still alone, unless
    /// `wanted` says another caller's rebuild made it needless meanwhile (`Ok(None)`),
    /// or another caller's rebuild failed while this one waited (that failure, told
    /// again: the endpoints were tried a moment ago).
    pub(crate) async fn run<T, F, Fut>(
        &self,
        wanted: impl Fn() -> bool,
        pass: F,
        install: impl FnOnce(T),
    ) -> Result<Option<()>, ClientError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let failed = self.failed.load(Ordering::Relaxed);
        let _one = self.one.lock().await;
        if !wanted() {
            return Ok(None);
        }
        if self.failed.load(Ordering::Relaxed) != failed {
            return Err(ClientError::connection(
                "every broker",
                "a reconnect just tried every endpoint and none answered",
            ));
        }
        match pass().await {
            Ok(v) => {
                install(v);
                Ok(Some(()))
            }
            Err(e) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }
}

/// After which failures an operation may be sent again.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Resend<'a> {
    /// After any retryable failure, the broker's `outcome_unknown` included: a second
    /// application changes nothing (a put, a read).
    Always,
    /// Not after the broker says the outcome is unknown; after a lost connection, a
    /// timeout or an answer that could not be read, which may have followed an
    /// application (at-least-once).
    NotUnknown,
    /// After no failure that may have followed the send (the broker's
    /// `outcome_unknown`, a lost connection, a timeout, an unreadable answer): it gives
    /// up in doubt instead, for a write that would apply twice. `sent` says whether the
    /// failed attempt got as far as sending: one that failed before (its connection
    /// closed already) is retried as any other.
    Never {
        /// Set by the attempt once it sends.
        sent: &'a AtomicBool,
    },
}

/// The longest a broker's `retry_after_ms` holds a retry back: a broker asking for an
/// hour would otherwise hold the call that long (with no deadline set).
pub(crate) const RETRY_AFTER_MAX: Duration = Duration::from_secs(30);

/// Connects to the first endpoint that answers, under the policy. A credential failure
/// returns at once: it would fail the same way on every broker.
async fn establish(
    endpoints: &[SocketAddr],
    server_name: &str,
    config: &ClientConfig,
    policy: &ReconnectPolicy,
    rng: &Mutex<rand::rngs::StdRng>,
) -> Result<Client, ClientError> {
    let unit = || -> f64 { rng.lock().expect("rng lock").random() };
    connect_any(endpoints, policy, unit, |addr| {
        Client::connect(addr, server_name, config.clone())
    })
    .await
}

/// The retry loop of [`ClusterClient::with_retry`], with the attempt, the reconnect
/// and the jitter passed in so it can be tested on a virtual clock. Giving up says
/// whether any attempt ended without knowing if it applied (`in_doubt`): the last
/// error alone (say, a connection refused) would read as nothing written.
pub(crate) async fn retry_under<T, Op, OpFut, Re, ReFut>(
    policy: &ReconnectPolicy,
    resend: Resend<'_>,
    endpoints: usize,
    mut jitter: impl FnMut(usize) -> Duration,
    mut op: Op,
    mut reconnect: Re,
) -> Result<T, ClientError>
where
    Op: FnMut() -> OpFut,
    OpFut: std::future::Future<Output = Result<T, ClientError>>,
    Re: FnMut() -> ReFut,
    ReFut: std::future::Future<Output = Result<(), ClientError>>,
{
    let started = Instant::now();
    let mut first_not_found: Option<Instant> = None;
    let mut last = None;
    let mut in_doubt = false;
    let mut made = 0;
    for attempt in 0..policy.attempts.max(1) {
        made = attempt + 1;
        let e = match op().await {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if crate::retry::is_not_found(&e) {
            first_not_found.get_or_insert_with(Instant::now);
        }
        let since_nf = first_not_found.map_or(Duration::ZERO, |t| t.elapsed());
        let mut wait = jitter(attempt);
        let decision = classify(&e, since_nf);
        // A lost connection, a timeout or an answer that could not be read may have
        // come after the request was sent (and applied).
        let doubtful = decision == Decision::OutcomeUnknown
            || matches!(
                e,
                ClientError::Connection { .. } | ClientError::Timeout(_) | ClientError::Protocol(_)
            );
        let doubtful = doubtful
            && match resend {
                Resend::Never { sent } => sent.load(Ordering::Relaxed),
                _ => true,
            };
        in_doubt |= doubtful;
        if doubtful && matches!(resend, Resend::Never { .. }) {
            if decision == Decision::Reconnect {
                // So the next call finds a live connection; this one is not sent again.
                let _ = reconnect().await;
            }
            return Err(ClientError::GaveUp {
                attempts: attempt + 1,
                endpoints,
                in_doubt,
                last: Box::new(e),
            });
        }
        match decision {
            // Failing now, it may still have applied before: say so.
            Decision::Fail if in_doubt => {
                return Err(ClientError::GaveUp {
                    attempts: attempt + 1,
                    endpoints,
                    in_doubt,
                    last: Box::new(e),
                });
            }
            Decision::Fail => return Err(e),
            Decision::OutcomeUnknown if !matches!(resend, Resend::Always) => return Err(e),
            Decision::OutcomeUnknown => {}
            Decision::Retry { at_least } => wait = wait.max(at_least.min(RETRY_AFTER_MAX)),
            Decision::Reconnect => {
                if let Err(re) = reconnect().await
                    && re.is_credential_failure()
                {
                    return Err(re);
                }
            }
        }
        last = Some(e);
        if attempt + 1 == policy.attempts {
            break;
        }
        if let Some(deadline) = policy.deadline
            && started.elapsed() + wait >= deadline
        {
            break;
        }
        tokio::time::sleep(wait).await;
    }
    Err(ClientError::GaveUp {
        // Those made: a deadline can end the loop before the policy's count.
        attempts: made,
        endpoints,
        in_doubt,
        last: Box::new(last.unwrap_or(ClientError::Timeout("no attempt made"))),
    })
}

/// The reconnect loop, with the connection step and the jitter source passed in so it
/// can be tested on a virtual clock: every attempt tries every endpoint in order;
/// between attempts it sleeps a full-jitter backoff; a deadline (checked before each
/// sleep and after each endpoint) ends it early.
pub(crate) async fn connect_any<T, F, Fut>(
    endpoints: &[SocketAddr],
    policy: &ReconnectPolicy,
    mut unit: impl FnMut() -> f64,
    mut connect: F,
) -> Result<T, ClientError>
where
    F: FnMut(SocketAddr) -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let started = Instant::now();
    let mut last = None;
    let attempts = policy.attempts.max(1);
    let gave_up = |attempts: usize, last: Option<ClientError>| ClientError::GaveUp {
        attempts,
        endpoints: endpoints.len(),
        in_doubt: false,
        last: Box::new(last.unwrap_or(ClientError::Config("no endpoints".into()))),
    };
    for attempt in 0..attempts {
        for &addr in endpoints {
            match connect(addr).await {
                Ok(c) => return Ok(c),
                Err(e) if e.is_credential_failure() => return Err(e),
                Err(e) => last = Some(e),
            }
            if policy.deadline.is_some_and(|d| started.elapsed() >= d) {
                return Err(gave_up(attempt + 1, last));
            }
        }
        if attempt + 1 == attempts {
            break;
        }
        let wait = policy.delay(attempt, unit());
        if let Some(d) = policy.deadline
            && started.elapsed() + wait >= d
        {
            return Err(gave_up(attempt + 1, last));
        }
        tokio::time::sleep(wait).await;
    }
    Err(gave_up(attempts, last))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::error::BrokerError;

    /// Compiles only if the client's futures can move between threads (a
    /// multi-threaded runtime's `spawn` needs that).
    #[allow(dead_code)]
    fn futures_are_send(seeds: &[SocketAddr], config: ClientConfig, c: &ClusterClient) {
        fn send<T: Send>(_: &T) {}
        send(&ClusterClient::connect(seeds, "localhost", config));
        send(&c.publish("t", "n", "s", Vec::new(), AckMode::PerMessage));
        send(&c.subscribe_shard("t", "n", "s", 0, None));
    }

    fn seeds() -> Vec<SocketAddr> {
        vec![
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ]
    }

    /// Each connect takes `cost` of virtual time and fails with `err`.
    type Attempt<'a> =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), ClientError>> + 'a>>;

    fn failing<'a>(
        cost: Duration,
        err: ClientError,
        log: &'a RefCell<Vec<Instant>>,
    ) -> impl FnMut(SocketAddr) -> Attempt<'a> + 'a {
        move |_| {
            let err = err.clone();
            Box::pin(async move {
                log.borrow_mut().push(Instant::now());
                tokio::time::sleep(cost).await;
                Err(err)
            })
        }
    }

    fn coded(code: felix_wire::ErrorCode) -> ClientError {
        ClientError::Broker(BrokerError {
            retry: Some(code.default_retry()),
            code: Some(code),
            detail: None,
            message: "x".into(),
            context: "test",
        })
    }

    /// Runs the retry loop over `errors`, one per attempt, reconnecting for free.
    async fn give_up_over(errors: Vec<ClientError>) -> ClientError {
        let policy = ReconnectPolicy {
            attempts: errors.len(),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
            deadline: None,
        };
        let errors = RefCell::new(errors.into_iter());
        let r: Result<(), _> = retry_under(
            &policy,
            Resend::Always,
            2,
            |_| Duration::from_millis(1),
            || {
                let e = errors.borrow_mut().next().expect("one error an attempt");
                async move { Err(e) }
            },
            || async { Ok(()) },
        )
        .await;
        r.unwrap_err()
    }

    /// Runs the retry loop under `resend` over `answers`, one per attempt (reconnecting
    /// for free); returns the outcome and how many attempts ran.
    async fn attempts_over(
        resend: Resend<'_>,
        answers: Vec<Result<u64, ClientError>>,
    ) -> (Result<u64, ClientError>, usize) {
        let policy = ReconnectPolicy {
            attempts: answers.len(),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
            deadline: None,
        };
        let answers = RefCell::new(answers.into_iter());
        let ran = RefCell::new(0);
        let r = retry_under(
            &policy,
            resend,
            1,
            |_| Duration::from_millis(1),
            || {
                *ran.borrow_mut() += 1;
                let a = answers.borrow_mut().next().expect("one answer an attempt");
                async move { a }
            },
            || async { Ok(()) },
        )
        .await;
        (r, ran.into_inner())
    }

    /// A commit without an expected offset is not sent again after a failure that may
    /// have followed its application (it would append its event twice); it gives up in
    /// doubt. A refusal that says nothing was written is still retried.
    #[tokio::test(start_paused = true)]
    async fn a_write_that_must_not_apply_twice_is_not_resent_once_in_doubt() {
        use felix_wire::ErrorCode;
        for doubt in [
            ClientError::Timeout("commit"),
            ClientError::connection("x", "reset"),
            ClientError::Protocol("an answer that does not decode".into()),
            coded(ErrorCode::Unacknowledged),
        ] {
            let sent = AtomicBool::new(true);
            let (r, ran) =
                attempts_over(Resend::Never { sent: &sent }, vec![Err(doubt), Ok(7)]).await;
            assert_eq!(ran, 1, "sent again after {r:?}");
            assert!(
                matches!(
                    r,
                    Err(ClientError::GaveUp {
                        in_doubt: true,
                        attempts: 1,
                        ..
                    })
                ),
                "{r:?}"
            );
            // At-least-once writes are resent after the same failures, except the
            // broker's own outcome_unknown.
        }
        let (r, ran) = attempts_over(
            Resend::NotUnknown,
            vec![Err(ClientError::Timeout("commit")), Ok(7)],
        )
        .await;
        assert_eq!((r.ok(), ran), (Some(7), 2));
        let sent = AtomicBool::new(true);
        let (r, ran) = attempts_over(
            Resend::Never { sent: &sent },
            vec![Err(coded(ErrorCode::ShardUnavailable)), Ok(7)],
        )
        .await;
        assert_eq!((r.ok(), ran), (Some(7), 2), "nothing written: retried");
        // A lost connection before anything was sent (it had closed already): retried.
        let sent = AtomicBool::new(false);
        let (r, ran) = attempts_over(
            Resend::Never { sent: &sent },
            vec![Err(ClientError::connection("x", "closed")), Ok(7)],
        )
        .await;
        assert_eq!((r.ok(), ran), (Some(7), 2), "not sent: retried");
    }

    /// A broker's `retry_after_ms` holds a retry back at most [`RETRY_AFTER_MAX`].
    #[tokio::test(start_paused = true)]
    async fn a_brokers_retry_after_is_capped() {
        let overloaded = ClientError::Broker(BrokerError {
            retry: Some(felix_wire::RetryClass::RetryAfter),
            code: Some(felix_wire::ErrorCode::Overloaded),
            detail: Some(felix_wire::ErrorDetail {
                reason: None,
                retry_after_ms: Some(3_600_000),
            }),
            message: "x".into(),
            context: "test",
        });
        let started = Instant::now();
        let (r, ran) = attempts_over(Resend::Always, vec![Err(overloaded), Ok(1)]).await;
        assert_eq!((r.ok(), ran), (Some(1), 2));
        let waited = started.elapsed();
        assert!(
            waited >= RETRY_AFTER_MAX && waited < RETRY_AFTER_MAX + Duration::from_secs(1),
            "waited {waited:?}"
        );
    }

    /// Callers that waited for a rebuild that failed take its failure instead of each
    /// trying every endpoint again in turn; the next call after it tries again.
    #[tokio::test(start_paused = true)]
    async fn callers_waiting_for_a_failed_rebuild_take_its_failure() {
        let rebuild = Rebuild::default();
        let passes = RefCell::new(0);
        let pass = || {
            *passes.borrow_mut() += 1;
            async {
                tokio::time::sleep(Duration::from_secs(6)).await;
                Err::<(), _>(ClientError::connection("x", "refused"))
            }
        };
        let started = Instant::now();
        let (a, b, c) = tokio::join!(
            rebuild.run(|| true, pass, |_| {}),
            rebuild.run(|| true, pass, |_| {}),
            rebuild.run(|| true, pass, |_| {}),
        );
        assert!(a.is_err() && b.is_err() && c.is_err());
        assert_eq!(*passes.borrow(), 1, "one pass for the three");
        assert!(
            started.elapsed() < Duration::from_secs(7),
            "{:?}",
            started.elapsed()
        );
        assert!(rebuild.run(|| true, pass, |_| {}).await.is_err());
        assert_eq!(*passes.borrow(), 2, "a later call tries again");
        // One made needless meanwhile runs nothing.
        assert!(matches!(
            rebuild.run(|| false, pass, |_| {}).await,
            Ok(None)
        ));
        assert_eq!(*passes.borrow(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn giving_up_says_an_earlier_attempt_may_have_applied() {
        use felix_wire::ErrorCode;
        // The write may have landed in the first attempt; the last only says the
        // broker could not be reached.
        let e = give_up_over(vec![
            coded(ErrorCode::Unacknowledged),
            coded(ErrorCode::ShardUnavailable),
            coded(ErrorCode::ShardUnavailable),
        ])
        .await;
        assert!(
            matches!(&e, ClientError::GaveUp { in_doubt: true, attempts: 3, last, .. }
                if matches!(**last, ClientError::Broker(_))),
            "{e:?}"
        );
        assert!(e.to_string().contains("outcome is unknown"), "{e}");
        let e = give_up_over(vec![
            ClientError::Timeout("publish ack"),
            ClientError::connection("x", "refused"),
        ])
        .await;
        assert!(
            matches!(e, ClientError::GaveUp { in_doubt: true, .. }),
            "{e:?}"
        );
        // A fatal answer after an attempt that may have applied keeps the doubt.
        let e = give_up_over(vec![
            ClientError::Timeout("publish ack"),
            coded(ErrorCode::Forbidden),
            coded(ErrorCode::Forbidden),
        ])
        .await;
        assert!(
            matches!(
                &e,
                ClientError::GaveUp {
                    in_doubt: true,
                    attempts: 2,
                    ..
                }
            ),
            "{e:?}"
        );
        // An answer that could not be read (an ack that did not decode, one over the
        // frame limit) may follow a write that applied.
        let e = give_up_over(vec![
            ClientError::Protocol("an ack that does not decode".into()),
            coded(ErrorCode::ShardUnavailable),
        ])
        .await;
        assert!(
            matches!(e, ClientError::GaveUp { in_doubt: true, .. }),
            "{e:?}"
        );
        // Refused every time before anything was written: not in doubt.
        let e = give_up_over(vec![
            coded(ErrorCode::ShardUnavailable),
            coded(ErrorCode::ShardUnavailable),
        ])
        .await;
        assert!(
            matches!(
                e,
                ClientError::GaveUp {
                    in_doubt: false,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_try_every_endpoint_and_sleep_within_the_jitter_ceiling() {
        let policy = ReconnectPolicy {
            attempts: 4,
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_millis(500),
            deadline: None,
        };
        let log = RefCell::new(Vec::new());
        let start = Instant::now();
        let r = connect_any(
            &seeds(),
            &policy,
            || 0.999,
            failing(
                Duration::from_millis(100),
                ClientError::connection("x", "refused"),
                &log,
            ),
        )
        .await;
        assert!(
            matches!(
                r,
                Err(ClientError::GaveUp {
                    attempts: 4,
                    endpoints: 2,
                    ..
                })
            ),
            "{r:?}"
        );
        let tries = log.borrow();
        assert_eq!(tries.len(), 8, "4 attempts x 2 endpoints");
        // Gaps between attempts: 100 ms of the second endpoint, then the sleep; the
        // sleeps (unit 0.999) sit just under 200, 400 and the 500 cap.
        for (i, cap) in [200u64, 400, 500].into_iter().enumerate() {
            let gap = tries[2 * i + 2] - tries[2 * i + 1] - Duration::from_millis(100);
            assert!(
                gap <= Duration::from_millis(cap),
                "sleep {i} = {gap:?} over {cap} ms"
            );
            assert!(
                gap >= Duration::from_millis(cap * 99 / 100),
                "sleep {i} = {gap:?} is full jitter near the ceiling"
            );
        }
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    /// A call its deadline ends early says how many attempts it made, not the policy's.
    #[tokio::test(start_paused = true)]
    async fn a_call_ended_by_its_deadline_counts_the_attempts_it_made() {
        let policy = ReconnectPolicy {
            deadline: Some(Duration::from_millis(250)),
            ..ReconnectPolicy::default()
        };
        let r: Result<(), _> = retry_under(
            &policy,
            Resend::Always,
            1,
            |_| Duration::from_millis(100),
            || async { Err(ClientError::Timeout("request")) },
            || async { Ok(()) },
        )
        .await;
        // At 0, 100 and 200 ms; a fourth would start past the deadline.
        assert!(
            matches!(r, Err(ClientError::GaveUp { attempts: 3, .. })),
            "{r:?}"
        );
    }

    /// A retried call with every broker down makes `attempts` rounds over the
    /// endpoints in all, not `attempts` rounds of reconnects of `attempts` rounds each:
    /// at the defaults, with 6 s handshakes to two dead brokers, 5 x 2 connects and
    /// about a minute, where it made 5 x 5 x 2 and about five.
    #[tokio::test(start_paused = true)]
    async fn a_retried_call_with_the_cluster_down_makes_its_attempts_rounds_in_all() {
        let policy = ReconnectPolicy::default();
        let round = policy.one_round();
        let connects = RefCell::new(Vec::new());
        let calls = RefCell::new(0);
        let seeds = seeds();
        let start = Instant::now();
        let r: Result<(), _> = retry_under(
            &policy,
            Resend::Always,
            2,
            |_| Duration::from_millis(100),
            || {
                *calls.borrow_mut() += 1;
                async { Err(ClientError::connection("x", "closed")) }
            },
            || {
                connect_any(
                    &seeds,
                    &round,
                    || 0.5,
                    failing(
                        Duration::from_secs(6),
                        ClientError::Timeout("handshake"),
                        &connects,
                    ),
                )
            },
        )
        .await;
        assert!(
            matches!(r, Err(ClientError::GaveUp { attempts: 5, .. })),
            "{r:?}"
        );
        assert_eq!(*calls.borrow(), 5);
        assert_eq!(connects.borrow().len(), 5 * 2, "one round a reconnect");
        assert!(
            start.elapsed() < Duration::from_secs(61),
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn zero_jitter_retries_at_once() {
        let policy = ReconnectPolicy::default();
        let log = RefCell::new(Vec::new());
        let start = Instant::now();
        let _ = connect_any(
            &seeds()[..1],
            &policy,
            || 0.0,
            failing(
                Duration::from_millis(10),
                ClientError::connection("x", "refused"),
                &log,
            ),
        )
        .await;
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(50),
            "5 attempts x 10 ms, no sleeping"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_shorter_than_one_attempt_allows_no_retry() {
        let policy = ReconnectPolicy {
            deadline: Some(Duration::from_secs(1)),
            ..ReconnectPolicy::default()
        };
        let log = RefCell::new(Vec::new());
        let start = Instant::now();
        let r = connect_any(
            &seeds()[..1],
            &policy,
            || 0.5,
            failing(
                Duration::from_secs(6),
                ClientError::Timeout("handshake"),
                &log,
            ),
        )
        .await;
        assert!(
            matches!(r, Err(ClientError::GaveUp { attempts: 1, .. })),
            "{r:?}"
        );
        assert_eq!(log.borrow().len(), 1, "the first attempt spent the budget");
        assert_eq!(start.elapsed(), Duration::from_secs(6));
    }

    #[tokio::test(start_paused = true)]
    async fn a_credential_failure_is_terminal_and_immediate() {
        let policy = ReconnectPolicy::default();
        let log = RefCell::new(Vec::new());
        let denied = ClientError::Broker(BrokerError {
            code: Some(felix_wire::ErrorCode::Unauthenticated),
            retry: Some(felix_wire::RetryClass::Fatal),
            detail: None,
            message: "bad token".into(),
            context: "auth rejected",
        });
        let start = Instant::now();
        let r = connect_any(
            &seeds(),
            &policy,
            || 0.5,
            failing(Duration::from_millis(5), denied.clone(), &log),
        )
        .await;
        assert!(matches!(&r, Err(e) if e.is_credential_failure()), "{r:?}");
        assert_eq!(log.borrow().len(), 1, "not retried, not tried elsewhere");
        assert_eq!(start.elapsed(), Duration::from_millis(5));
    }
}
