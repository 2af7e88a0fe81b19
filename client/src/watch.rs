//! Cache watches (`cache_watch`): the puts and deletes of one key, or of every key of a
//! prefix on one cache shard, in log order, live from the tail, replayed from an
//! offset, or starting with the current values (retained). The broker answers on the
//! request's stream, then sends the changes on an event stream of their own, as for a
//! subscription; counters are not cache changes and never appear.

use bytes::Bytes;
use felix_wire::flags::FrameKind;
use felix_wire::{Features, FrameReader, Message, Offset, ShardId};
use tokio::sync::mpsc;

use crate::client::{
    Client, EndSlot, Feed, SubscriptionEnd, broker_error, read_frame, read_message, record_moved,
};
use crate::error::ClientError;

/// What a watch follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheWatchFilter {
    /// One key.
    Key(String),
    /// Every key starting with `prefix` on one cache shard.
    Prefix {
        /// The prefix (`""`: every key of the shard).
        prefix: String,
        /// The cache shard: `None` only for a cache of one shard (a cache of several
        /// refuses a prefix watch that names none, `invalid_request`, rather than watch
        /// one of them).
        shard: Option<u32>,
    },
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheWatchStart {
    /// The changes from now on.
    Now,
    /// The changes from this offset on; one the log no longer holds (compacted, or past
    /// its end) starts over from the current values ([`CacheWatch::resnapshotted`]).
    Offset(u64),
    /// The current values first, then the changes from then on.
    Retained,
}

/// One put or delete a watch saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheChange {
    /// The key.
    pub key: String,
    /// The value put; `None` for a delete (an expiry is one too).
    pub value: Option<Bytes>,
    /// The write's offset in the cache's log (a put's offset is its value's version).
    pub offset: u64,
    /// When the value expires (Unix milliseconds), 0 for never.
    pub expires_at_millis: u64,
}

/// A cache watch: its changes, in log order, until the broker ends it.
#[derive(Debug)]
pub struct CacheWatch {
    feed: Feed<CacheChange>,
    live_offset: u64,
    resnapshotted: bool,
    retained_count: Option<u64>,
}

impl CacheWatch {
    /// The next change; `Ok(None)` when the broker ended the watch cleanly (see
    /// [`CacheWatch::end`]); [`ClientError::SubscriptionLagged`] when it ended it with
    /// `cache_watch_lagged` (watch again from `resume_from`); an error when the
    /// connection was lost. Cancel-safe.
    pub async fn next_change(&mut self) -> Result<Option<CacheChange>, ClientError> {
        self.feed.next().await
    }

    /// Why the broker ended the watch, once [`CacheWatch::next_change`] returned
    /// `Ok(None)`: the shard moved (watch again at the new owner from `resume_from`).
    pub fn end(&self) -> Option<SubscriptionEnd> {
        self.feed.end()
    }

    /// Where the changes after the current values (if any came first) begin.
    pub fn live_offset(&self) -> u64 {
        self.live_offset
    }

    /// The offset asked for was no longer in the log (compacted, or past its end): the
    /// watch started with the current values instead, then goes on live.
    pub fn resnapshotted(&self) -> bool {
        self.resnapshotted
    }

    /// How many current values come first (a retained or resnapshotted watch).
    pub fn retained_count(&self) -> Option<u64> {
        self.retained_count
    }
}

impl Client {
    /// Watches the changes `filter` follows on `cache`, from `start`.
    pub async fn watch_cache(
        &self,
        tenant: &str,
        namespace: &str,
        cache: &str,
        filter: &CacheWatchFilter,
        start: CacheWatchStart,
    ) -> Result<CacheWatch, ClientError> {
        self.check_tenant(tenant)?;
        self.require(Features::CACHE_WATCH, "watch_cache")?;
        let (from_offset, retained) = match start {
            CacheWatchStart::Now => (None, false),
            CacheWatchStart::Offset(o) => (Some(o), false),
            CacheWatchStart::Retained => {
                self.require(Features::CACHE_WATCH_RETAINED, "a retained cache watch")?;
                (None, true)
            }
        };
        let (key, prefix, shard) = match filter {
            CacheWatchFilter::Key(k) => (Some(k.clone()), None, None),
            CacheWatchFilter::Prefix { prefix, shard } => {
                (None, Some(prefix.clone()), shard.map(ShardId))
            }
        };
        let mut s = self.open_request_stream().await?;
        let m = Message::CacheWatch {
            tenant_id: tenant.into(),
            namespace: namespace.into(),
            cache: cache.into(),
            key,
            prefix,
            shard,
            from_offset: from_offset.map(Offset),
            retained,
            subscription_id: None,
        };
        s.send
            .write_all(&m.to_frame())
            .await
            .map_err(|e| ClientError::connection(self.addr(), e))?;
        let _ = s.send.finish();
        let answer =
            tokio::time::timeout(self.request_timeout(), read_message(&mut s, "cache_watch"))
                .await
                .map_err(|_| ClientError::Timeout("cache_watch"))??;
        let (id, live_offset, resnapshotted, retained_count) = match answer {
            Message::CacheWatchStarted {
                subscription_id,
                resume_offset,
                resnapshot,
                retained_count,
            } => (
                subscription_id.0,
                resume_offset.0,
                resnapshot,
                retained_count,
            ),
            other => return Err(broker_error("cache_watch", other)),
        };
        let (recv, reader) = self.event_stream(id).await?;
        let feed = Feed::spawn(self.sub_queue_capacity(), s.recv, |tx, end| {
            read_changes(recv, reader, tx, end)
        });
        Ok(CacheWatch {
            feed,
            live_offset,
            resnapshotted,
            retained_count,
        })
    }
}

async fn read_changes(
    mut recv: quinn::RecvStream,
    mut reader: FrameReader,
    tx: mpsc::Sender<Result<CacheChange, ClientError>>,
    end: EndSlot,
) {
    loop {
        // A dropped watch ends here at once: dropping the event stream tells the
        // broker to stop.
        let read = tokio::select! {
            read = read_frame(&mut recv, &mut reader) => read,
            () = tx.closed() => return,
        };
        let change = match read {
            Ok(Some(f)) if f.kind == FrameKind::Json => match Message::decode(&f.payload) {
                Ok(Message::CacheEvent {
                    key,
                    value,
                    offset,
                    expires_at_millis,
                }) => Ok(CacheChange {
                    key,
                    value,
                    offset: offset.0,
                    expires_at_millis,
                }),
                Ok(Message::CacheWatchLagged { resume_from }) => {
                    Err(ClientError::SubscriptionLagged {
                        resume_from: resume_from.0,
                    })
                }
                Ok(m @ Message::ShardMoved { .. }) => {
                    record_moved(&end, m);
                    return;
                }
                Ok(_) => continue,
                Err(e) => Err(ClientError::Protocol(e.to_string())),
            },
            Ok(Some(_)) => Err(ClientError::Protocol(
                "unexpected frame on a cache watch's event stream".into(),
            )),
            Ok(None) => return,
            Err(e) => Err(ClientError::SubscriptionLost(e.to_string())),
        };
        let last = change.is_err();
        // Waiting here pushes back on the broker through QUIC flow control.
        if tx.send(change).await.is_err() || last {
            return;
        }
    }
}
