//! Reading a whole multi-shard stream: one subscription per shard, merged.
//!
//! Ordering is per shard only. Opening covers every shard or fails naming the shards it
//! could not reach. A lost shard is re-established on its own, resuming after the last
//! offset it delivered, and announced with `ShardLost` / `ShardRecovered`; the other
//! shards keep delivering. A shard that moved to another broker is followed there at
//! once and announced with `ShardMoved`; a deleted stream's shards end with
//! `StreamDeleted`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use felix_wire::Offset;
use felix_wire::message::StartPosition;
use tokio::sync::mpsc;

use crate::client::{Event, SubscriptionEnd};
use crate::cluster::ClusterClient;
use crate::error::ClientError;

/// One offset per shard: the last delivered.
pub type ShardOffsets = BTreeMap<u32, u64>;

/// Pause before re-establishing a lost shard.
const RECOVER_PAUSE: Duration = Duration::from_millis(250);

/// What a sharded subscription yields: the standard SDK's five kinds. Exhaustive, as
/// there: code written from the guide's three-arm match adds the `ShardMoved` and
/// `StreamDeleted` arms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardEvent {
    /// A record from `shard`.
    Record {
        /// The shard.
        shard: u32,
        /// The record.
        event: Event,
    },
    /// The shard's owner is gone; it is being re-established. Not an error and not
    /// silence: the other shards still deliver.
    ShardLost {
        /// The shard.
        shard: u32,
        /// Why.
        error: String,
    },
    /// The shard is delivering again, from where it stopped.
    ShardRecovered {
        /// The shard.
        shard: u32,
    },
    /// The shard moved to another broker (a planned move or drain); the subscription
    /// follows it and resumes after the last offset it delivered. A notice, not an end.
    ShardMoved {
        /// The shard.
        shard: u32,
        /// The first offset its old owner had not delivered, when it said.
        resume_from: Option<u64>,
        /// The new owner.
        node_id: Option<String>,
        /// The new owner's client address, when it publishes one.
        addr: Option<String>,
        /// The assignment generation that moved it.
        generation: u64,
    },
    /// The stream was deleted: this shard's feed ended and is not re-established.
    StreamDeleted {
        /// The shard.
        shard: u32,
    },
}

/// A subscription over every shard of a stream.
#[derive(Debug)]
pub struct ShardedSubscription {
    rx: mpsc::Receiver<ShardEvent>,
    /// The last offset handed to the application per shard, by [`Self::next`]: what
    /// [`Self::positions`] answers. (The shard tasks' own positions run ahead of it by
    /// what waits in the channel: a resume from those skipped what the application
    /// never got.)
    delivered: ShardOffsets,
    shards: u32,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ShardedSubscription {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl ShardedSubscription {
    /// The next item.
    pub async fn next(&mut self) -> Option<ShardEvent> {
        let item = self.rx.recv().await;
        if let Some(ShardEvent::Record { shard, event }) = &item
            && let Some(o) = event.offset
        {
            self.delivered.insert(*shard, o);
        }
        item
    }

    /// The last offset handed out by [`Self::next`] per shard (only shards that
    /// delivered, and those the subscription resumed): pass it to
    /// [`ClusterClient::resubscribe_sharded`] to carry on after the last record taken.
    pub fn positions(&self) -> ShardOffsets {
        self.delivered.clone()
    }

    /// Shard count.
    pub fn shards(&self) -> u32 {
        self.shards
    }
}

impl ClusterClient {
    /// Subscribes to every shard of a stream from `start` (absent = latest).
    pub async fn subscribe_sharded(
        self: &Arc<Self>,
        tenant: &str,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
    ) -> Result<ShardedSubscription, ClientError> {
        self.resubscribe_sharded(tenant, namespace, stream, ShardOffsets::new(), start)
            .await
    }

    /// Like [`ClusterClient::subscribe_sharded`], resuming listed shards at their
    /// offset + 1 and starting the others at `start`.
    pub async fn resubscribe_sharded(
        self: &Arc<Self>,
        tenant: &str,
        namespace: &str,
        stream: &str,
        offsets: ShardOffsets,
        start: Option<StartPosition>,
    ) -> Result<ShardedSubscription, ClientError> {
        let shards = self.stream_shards(tenant, namespace, stream).await?;
        if shards == 0 {
            return Err(ClientError::Broker(crate::error::BrokerError {
                code: Some(felix_wire::ErrorCode::NotFound),
                retry: Some(felix_wire::RetryClass::Fatal),
                detail: None,
                message: format!(
                    "stream {tenant}/{namespace}/{stream} has no shards (unknown to the broker)"
                ),
                context: "subscribe_sharded",
            }));
        }
        let start_of = |shard: u32| match offsets.get(&shard) {
            Some(o) => Some(StartPosition::Offset(Offset(o + 1))),
            None => start,
        };
        let opened = futures_join_all((0..shards).map(|shard| {
            let cc = self.clone();
            let (t, n, s) = (tenant.to_owned(), namespace.to_owned(), stream.to_owned());
            async move {
                let r = open_past_retention(shard, start_of(shard), |at| {
                    cc.subscribe_shard(&t, &n, &s, shard, at)
                })
                .await;
                (shard, r)
            }
        }))
        .await;
        let failed: Vec<String> = opened
            .iter()
            .filter_map(|(shard, r)| r.as_ref().err().map(|e| format!("shard {shard}: {e}")))
            .collect();
        if !failed.is_empty() {
            return Err(ClientError::Protocol(format!(
                "could not open every shard of {tenant}/{namespace}/{stream}: {}",
                failed.join("; ")
            )));
        }
        let (tx, rx) = mpsc::channel(64 * shards as usize);
        let delivered = offsets.clone();
        let positions = Arc::new(Mutex::new(offsets));
        let mut tasks = Vec::new();
        for (shard, sub) in opened {
            let sub = sub.expect("checked above");
            let (cc, tx, positions) = (self.clone(), tx.clone(), positions.clone());
            let (t, n, s) = (tenant.to_owned(), namespace.to_owned(), stream.to_owned());
            tasks.push(tokio::spawn(async move {
                forward(cc, (t, n, s), shard, sub, start, tx, positions).await;
            }));
        }
        Ok(ShardedSubscription {
            rx,
            delivered,
            shards,
            tasks,
        })
    }
}

async fn forward(
    cc: Arc<ClusterClient>,
    (t, n, s): (String, String, String),
    shard: u32,
    mut sub: crate::client::Subscription,
    start: Option<StartPosition>,
    tx: mpsc::Sender<ShardEvent>,
    positions: Arc<Mutex<ShardOffsets>>,
) {
    // Where a shard that delivered nothing yet resumes: where its first subscription
    // began (a start at the latest record resumed at the latest again, and skipped
    // what was written while the shard was lost), or where the broker said it stopped
    // when the shard moved.
    let mut start = match sub.start_offset() {
        Some(o) => Some(StartPosition::Offset(Offset(o))),
        None => start,
    };
    loop {
        let error = loop {
            match sub.next_event().await {
                Ok(Some(event)) => {
                    if let Some(o) = event.offset {
                        positions.lock().expect("positions lock").insert(shard, o);
                    }
                    if tx.send(ShardEvent::Record { shard, event }).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break "the broker ended the subscription".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        let mut pause = RECOVER_PAUSE;
        match sub.end() {
            Some(SubscriptionEnd::StreamDeleted) => {
                let _ = tx.send(ShardEvent::StreamDeleted { shard }).await;
                return;
            }
            Some(SubscriptionEnd::Moved {
                resume_from,
                node_id,
                addr,
                generation,
            }) => {
                if let Some(r) = resume_from
                    && !positions
                        .lock()
                        .expect("positions lock")
                        .contains_key(&shard)
                {
                    start = Some(StartPosition::Offset(Offset(r)));
                }
                let moved = ShardEvent::ShardMoved {
                    shard,
                    resume_from,
                    node_id,
                    addr,
                    generation,
                };
                if tx.send(moved).await.is_err() {
                    return;
                }
                // Follow it at once: the new owner serves already.
                match cc
                    .subscribe_shard_once(&t, &n, &s, shard, resume_at(&positions, shard, start))
                    .await
                {
                    Ok(next) => {
                        sub = next;
                        continue;
                    }
                    Err(e) => {
                        if tx
                            .send(ShardEvent::ShardLost {
                                shard,
                                error: format!("following the move: {e}"),
                            })
                            .await
                            .is_err()
                        {
                            return;
                        }
                        pause = Duration::ZERO;
                    }
                }
            }
            None => {
                if tx
                    .send(ShardEvent::ShardLost { shard, error })
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        // Re-establish forever, resuming after the last offset delivered.
        sub = loop {
            tokio::time::sleep(pause).await;
            pause = RECOVER_PAUSE;
            let resume = resume_at(&positions, shard, start);
            let client = cc.client();
            match cc.subscribe_shard_once(&t, &n, &s, shard, resume).await {
                Ok(sub) => break sub,
                // Retention removed where it would resume (a lagged subscription lands
                // here): asking for it again failed forever. Go on from the oldest
                // retained.
                Err(e) => match oldest_retained(&e, shard) {
                    Some(o) if o > 0 => {
                        positions
                            .lock()
                            .expect("positions lock")
                            .insert(shard, o - 1);
                        pause = Duration::ZERO;
                    }
                    _ => {
                        if crate::retry::classify(&e, Duration::ZERO)
                            == crate::retry::Decision::Fail
                        {
                            tracing::warn!(shard, error = %e, "re-establishing a shard failed");
                        }
                        if client.is_closed() {
                            cc.replace_if_closed().await;
                        }
                    }
                },
            }
        };
        if tx.send(ShardEvent::ShardRecovered { shard }).await.is_err() {
            return;
        }
    }
}

/// The oldest record `shard` still holds when `e` refused a resume below it (retention
/// removed the records between, which are logged as skipped); `None` for any other
/// error.
fn oldest_retained(e: &ClientError, shard: u32) -> Option<u64> {
    let ClientError::Cursor(c) = e else {
        return None;
    };
    if c.reason != felix_wire::message::CursorErrorReason::TooOld {
        return None;
    }
    tracing::warn!(
        shard,
        from = c.requested,
        to = c.available,
        "records removed by retention before they were delivered: skipped"
    );
    Some(c.available)
}

/// How many times a resume opens again at the oldest retained record while retention
/// keeps removing it from under the open.
const RETAINED_OPENS_MAX: usize = 8;

/// Opens `shard` at `start`; where retention removed records since (positions taken
/// before a lag), from the oldest retained, as a lost shard does. Retention running
/// meanwhile may remove that one too before it opens: then again from the newer oldest,
/// up to [`RETAINED_OPENS_MAX`] times.
async fn open_past_retention<S, F, Fut>(
    shard: u32,
    start: Option<StartPosition>,
    mut open: F,
) -> Result<S, ClientError>
where
    F: FnMut(Option<StartPosition>) -> Fut,
    Fut: std::future::Future<Output = Result<S, ClientError>>,
{
    let mut at = start;
    let mut opens = 0;
    loop {
        opens += 1;
        match open(at).await {
            Err(e) if opens < RETAINED_OPENS_MAX => match oldest_retained(&e, shard) {
                Some(o) => at = Some(StartPosition::Offset(Offset(o))),
                None => return Err(e),
            },
            r => return r,
        }
    }
}

/// After the last offset delivered, or at `start` when none was.
fn resume_at(
    positions: &Mutex<ShardOffsets>,
    shard: u32,
    start: Option<StartPosition>,
) -> Option<StartPosition> {
    match positions.lock().expect("positions lock").get(&shard) {
        Some(o) => Some(StartPosition::Offset(Offset(o + 1))),
        None => start,
    }
}

/// Runs futures concurrently and collects their outputs in order.
async fn futures_join_all<F: std::future::Future>(
    futs: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in futs {
        set.push(f);
    }
    let mut out = Vec::with_capacity(set.len());
    // Poll all together: pin them and drive with a simple join.
    let mut pinned: Vec<_> = set.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (i, f) in pinned.iter_mut().enumerate() {
            if done[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => done[i] = Some(v),
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(done.into_iter().map(|d| d.expect("all done")));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SubscribeCursorError;
    use felix_wire::message::CursorErrorReason;

    fn too_old(requested: u64, available: u64) -> ClientError {
        ClientError::Cursor(SubscribeCursorError {
            reason: CursorErrorReason::TooOld,
            requested,
            available,
        })
    }

    /// Retention removes the oldest record twice between a refusal naming it and the
    /// open at it: the resume follows the oldest each time and opens at the fourth try.
    #[tokio::test]
    async fn a_resume_follows_retention_that_runs_while_it_opens() {
        let oldest = std::cell::Cell::new(10);
        let asked = std::cell::RefCell::new(Vec::new());
        let opened = open_past_retention(0, Some(StartPosition::Offset(Offset(1))), |at| {
            let StartPosition::Offset(Offset(o)) = at.expect("a position") else {
                panic!("{at:?}")
            };
            asked.borrow_mut().push(o);
            let held = oldest.get();
            if o < held {
                // Retention runs on twice while the refusals travel.
                if asked.borrow().len() <= 2 {
                    oldest.set(held + 5);
                }
                return std::future::ready(Err(too_old(o, held)));
            }
            std::future::ready(Ok(o))
        })
        .await
        .unwrap();
        assert_eq!(opened, 20);
        assert_eq!(*asked.borrow(), [1, 10, 15, 20]);
    }

    /// Another refusal is the caller's at once; a resume that retention outruns gives up
    /// after its bound with the last refusal.
    #[tokio::test]
    async fn a_resume_gives_up_on_other_errors_and_past_its_bound() {
        let mut asked = 0;
        let r: Result<u64, _> = open_past_retention(0, None, |_| {
            asked += 1;
            std::future::ready(Err(ClientError::Protocol("no".into())))
        })
        .await;
        assert!(matches!(r, Err(ClientError::Protocol(_))), "{r:?}");
        assert_eq!(asked, 1);
        let mut asked = 0;
        let r: Result<u64, _> = open_past_retention(0, None, |_| {
            asked += 1;
            std::future::ready(Err(too_old(0, asked)))
        })
        .await;
        assert!(matches!(r, Err(ClientError::Cursor(_))), "{r:?}");
        assert_eq!(asked, RETAINED_OPENS_MAX as u64);
    }
}
