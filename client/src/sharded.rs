//! Reading a whole multi-shard stream: one subscription per shard, merged.
//!
//! Ordering is per shard only. Opening covers every shard or fails naming the shards it
//! could not reach. A lost shard is re-established on its own, resuming after the last
//! offset it delivered, and announced with `ShardLost` / `ShardRecovered`; the other
//! shards keep delivering. A shard that moved to another broker is followed there at
//! once and announced with `ShardMoved`; a deleted stream's shards end with
//! `StreamDeleted` (a stream deleted while a shard is lost answers `not_found`, which is
//! not told apart from a broker that does not know it yet: that shard is tried again
//! for good, logged every 5 s).
//!
//! A lost shard is tried again after a random pause whose ceiling grows from 250 ms to
//! a second. It
//! resumes at the oldest retained record where retention removed where it would resume,
//! and at its log's end where the log now ends before it (a `Leader` stream's old
//! leader alone held what it delivered past there: the offsets are written again, and
//! delivered again; a resume from positions past the end opens there too). A
//! credential failure ends the shard's feed with a last `ShardLost` saying so (no
//! `ShardRecovered` follows), as the guide has a credential failure terminal;
//! everything else, `not_found` included, is tried again.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use felix_wire::Offset;
use felix_wire::message::{CursorErrorReason, StartPosition};
use tokio::sync::mpsc;

use crate::client::{Event, SubscriptionEnd};
use crate::cluster::ClusterClient;
use crate::error::ClientError;

/// One offset per shard: the last delivered.
pub type ShardOffsets = BTreeMap<u32, u64>;

/// The ceiling of the pause before re-establishing a lost shard.
const RECOVER_PAUSE: Duration = Duration::from_millis(250);
/// The most shards a stream has.
const STREAM_SHARDS_MAX: u32 = 4096;
/// The longest pause between tries to re-establish a lost shard.
const RECOVER_PAUSE_MAX: Duration = Duration::from_secs(1);

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
    /// silence: the other shards still deliver. Unless `error` says a credential
    /// failure stopped it: then no `ShardRecovered` follows and the shard's feed ends
    /// (the guide has a credential failure terminal).
    ShardLost {
        /// The shard.
        shard: u32,
        /// Why.
        error: String,
    },
    /// The shard is delivering again, from where it stopped, or from where retention or
    /// its log's end moved it (see [`ShardedSubscription::positions`]).
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

/// What a shard's task hands the subscription: an event for the application, or where
/// the shard now resumes, for [`ShardedSubscription::positions`], in its place among
/// the events.
#[derive(Debug)]
enum Item {
    Event(ShardEvent),
    /// The shard goes on after `before` (from its first offset: `None`): its log ended
    /// before where it was (what was delivered past that end is written again), or
    /// retention removed where it was. Positions taken after the events before this
    /// and before the next record said the old offset, and a resume from them skipped
    /// what was written again at those offsets (until 2026-12-08).
    Rewound {
        shard: u32,
        before: Option<u64>,
    },
}

/// A shard task's end of the channel.
#[derive(Clone)]
struct Feed(mpsc::Sender<Item>);

impl Feed {
    async fn send(&self, e: ShardEvent) -> Result<(), mpsc::error::SendError<Item>> {
        self.0.send(Item::Event(e)).await
    }
}

/// A subscription over every shard of a stream.
#[derive(Debug)]
pub struct ShardedSubscription {
    rx: mpsc::Receiver<Item>,
    /// The last offset handed to the application per shard, by [`Self::next`], or where
    /// a rewound shard goes on after: what [`Self::positions`] answers. (The shard
    /// tasks' own positions run ahead of it by what waits in the channel: a resume from
    /// those skipped what the application never got.)
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
        loop {
            match self.rx.recv().await? {
                Item::Event(item) => {
                    if let ShardEvent::Record { shard, event } = &item
                        && let Some(o) = event.offset
                    {
                        self.delivered.insert(*shard, o);
                    }
                    return Some(item);
                }
                Item::Rewound { shard, before } => match before {
                    Some(o) => {
                        self.delivered.insert(shard, o);
                    }
                    None => {
                        self.delivered.remove(&shard);
                    }
                },
            }
        }
    }

    /// The last offset handed out by [`Self::next`] per shard (only shards that
    /// delivered, and those the subscription resumed), or, where a shard's log ended
    /// before it or retention removed where it was, where it now goes on after
    /// (possibly below what was handed out; absent when it goes on from its first
    /// offset): pass it to [`ClusterClient::resubscribe_sharded`] to carry on after the
    /// last record taken.
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
    /// offset + 1 (or at the oldest retained record, or at the log's end where it now
    /// ends before that) and starting the others at `start`.
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
        // A stream has at most 4,096 shards (the control plane's and the broker's
        // bound): a broker answering more would have this open a subscription, and
        // size a channel, for each.
        if shards > STREAM_SHARDS_MAX {
            return Err(ClientError::Protocol(format!(
                "stream {tenant}/{namespace}/{stream}: the broker says {shards} shards, more than a stream has ({STREAM_SHARDS_MAX})"
            )));
        }
        let start_of = |shard: u32| match offsets.get(&shard) {
            Some(o) => Some(StartPosition::Offset(Offset(o.saturating_add(1)))),
            None => start,
        };
        let opened = futures_join_all((0..shards).map(|shard| {
            let cc = self.clone();
            let (t, n, s) = (tenant.to_owned(), namespace.to_owned(), stream.to_owned());
            // Only a resumed position follows the log's end back: a start the caller
            // named past the end is refused (records below it were asked to be skipped).
            let resumed = offsets.contains_key(&shard);
            async move {
                let r = open_past_retention(shard, start_of(shard), resumed, |at| {
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
        // A resumed shard that opened elsewhere (retention, the log's end) goes on from
        // there: left at the old position, a loss before its first record resumed there
        // again, past what was written again meanwhile.
        let mut offsets = offsets;
        for (shard, r) in &opened {
            if let Ok((_, Some(at))) = r
                && offsets.contains_key(shard)
            {
                match at.checked_sub(1) {
                    Some(before) => offsets.insert(*shard, before),
                    None => offsets.remove(shard),
                };
            }
        }
        let (tx, rx) = mpsc::channel(64 * shards as usize);
        let tx = Feed(tx);
        let delivered = offsets.clone();
        let positions = Arc::new(Mutex::new(offsets));
        let mut tasks = Vec::new();
        for (shard, opened) in opened {
            let (sub, _) = opened.expect("checked above");
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
    tx: Feed,
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
        let mut pause = recover_pause(0, cc.unit());
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
        // Re-establish, resuming after the last offset delivered: until it opens, or
        // until a credential failure (which no retry mends: the guide has it
        // terminal). Everything else is tried again, `not_found` included (a broker
        // promoted a moment ago reports a stream it is about to serve as missing; a
        // deletion while the shard is lost is not told apart). Each try waits longer,
        // up to a second (it tried 4 times a second for as long as the shard was down,
        // and forever after a credential failure, until 2026-12-08).
        let mut tries = 1;
        let mut first_not_found = None;
        sub = loop {
            tokio::time::sleep(pause).await;
            pause = recover_pause(tries, cc.unit());
            tries += 1;
            let resume = resume_at(&positions, shard, start);
            let client = cc.client();
            let e = match cc.subscribe_shard_once(&t, &n, &s, shard, resume).await {
                Ok(sub) => break sub,
                Err(e) => e,
            };
            // Retried for good, as the guide has it, but said every 5 s while it
            // lasts: the stream deleted meanwhile, or the token no longer reading it.
            if crate::retry::is_not_found(&e) {
                let since = *first_not_found.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= crate::retry::NOT_FOUND_GRACE {
                    tracing::warn!(shard, error = %e, "the shard's stream is not found; trying again");
                    first_not_found = Some(tokio::time::Instant::now());
                }
            } else {
                first_not_found = None;
            }
            let reconnected = if client.is_closed() {
                cc.replace_if_closed().await
            } else {
                Ok(())
            };
            match reopen_after(&e, reconnected.as_ref().err(), shard) {
                Reopen::At(o) => {
                    let before = o.checked_sub(1);
                    match before {
                        Some(before) => {
                            positions
                                .lock()
                                .expect("positions lock")
                                .insert(shard, before);
                        }
                        None => {
                            positions.lock().expect("positions lock").remove(&shard);
                            start = Some(StartPosition::Offset(Offset(0)));
                        }
                    }
                    if tx.0.send(Item::Rewound { shard, before }).await.is_err() {
                        return;
                    }
                    pause = Duration::ZERO;
                }
                Reopen::Again => {}
                Reopen::Never(error) => {
                    // Terminal, as the guide has a credential failure: no
                    // `ShardRecovered` follows, and the shard's feed ends.
                    let _ = tx.send(ShardEvent::ShardLost { shard, error }).await;
                    return;
                }
            }
        };
        if tx.send(ShardEvent::ShardRecovered { shard }).await.is_err() {
            return;
        }
    }
}

/// `e`'s refusal of a subscription's start for `reason`, if it is one.
fn refused_start(
    e: &ClientError,
    reason: CursorErrorReason,
) -> Option<&crate::error::SubscribeCursorError> {
    e.cursor().filter(|c| c.reason == reason)
}

/// The oldest record `shard` still holds when `e` refused a resume below it (retention
/// removed the records between, which are logged as skipped); `None` for any other
/// error.
fn oldest_retained(e: &ClientError, shard: u32) -> Option<u64> {
    let c = refused_start(e, CursorErrorReason::TooOld)?;
    tracing::warn!(
        shard,
        from = c.requested,
        to = c.available,
        "records removed by retention before they were delivered: skipped"
    );
    Some(c.available)
}

/// Where `shard`'s log ends when `e` refused a resume past it: what was delivered past
/// that end is gone (a `Leader` stream's tail its old leader alone held) and the offsets
/// are written again. Waiting for the log to grow back skipped every record written at
/// them meanwhile (until 2026-12-08); from the end, nothing is skipped, and what is
/// written there again is delivered again. `None` for any other error.
fn log_end_before(e: &ClientError, shard: u32) -> Option<u64> {
    let c = refused_start(e, CursorErrorReason::InFuture)?;
    tracing::warn!(
        shard,
        resume = c.requested,
        end = c.available,
        "the shard's log ends before where it resumes: records delivered past its end were lost; resuming at its end"
    );
    Some(c.available)
}

/// What a lost shard does after a try to open it again failed with `e` (and the
/// connection's replacement, where it was closed, with `reconnect`).
#[derive(Debug, PartialEq, Eq)]
enum Reopen {
    /// Open at this offset at once.
    At(u64),
    /// Try again after a pause.
    Again,
    /// No retry mends it: end with this error.
    Never(String),
}

fn reopen_after(e: &ClientError, reconnect: Option<&ClientError>, shard: u32) -> Reopen {
    if let Some(o) = oldest_retained(e, shard) {
        return Reopen::At(o);
    }
    if let Some(end) = log_end_before(e, shard) {
        return Reopen::At(end);
    }
    if let Some(credential) = [Some(e), reconnect]
        .into_iter()
        .flatten()
        .find(|e| e.is_credential_failure())
    {
        return Reopen::Never(format!(
            "{credential} (a credential failure: the shard is not re-established)"
        ));
    }
    if crate::retry::classify(e, Duration::ZERO) == crate::retry::Decision::Fail {
        tracing::warn!(shard, error = %e, "re-establishing a shard failed");
    }
    Reopen::Again
}

/// The pause before a lost shard's try number `tries` + 1 (0-based): under a ceiling
/// of 250 ms doubling to 1 s, at least half of it (`unit` in `[0, 1)` picks where):
/// random, so a cluster's subscribers do not retry in step.
fn recover_pause(tries: u32, unit: f64) -> Duration {
    let ceiling = RECOVER_PAUSE
        .saturating_mul(1 << tries.min(2))
        .min(RECOVER_PAUSE_MAX);
    ceiling.mul_f64(0.5 + unit.clamp(0.0, 1.0) / 2.0)
}

/// How many times a resume opens again at the oldest retained record (or at the log's
/// end) while retention keeps removing it from under the open.
const RETAINED_OPENS_MAX: usize = 8;

/// Opens `shard` at `start`; where retention removed records since (positions taken
/// before a lag), from the oldest retained, as a lost shard does, and with `resumed`
/// (`start` follows positions), where the log now ends before it, from its end.
/// Retention running meanwhile may remove the oldest too before it opens: then again
/// from the newer oldest, up to [`RETAINED_OPENS_MAX`] times. With the subscription,
/// where it opened when not at `start`.
async fn open_past_retention<S, F, Fut>(
    shard: u32,
    start: Option<StartPosition>,
    resumed: bool,
    mut open: F,
) -> Result<(S, Option<u64>), ClientError>
where
    F: FnMut(Option<StartPosition>) -> Fut,
    Fut: std::future::Future<Output = Result<S, ClientError>>,
{
    let mut at = start;
    let mut moved = None;
    let mut opens = 0;
    loop {
        opens += 1;
        match open(at).await {
            Err(e) if opens < RETAINED_OPENS_MAX => match oldest_retained(&e, shard)
                .or_else(|| log_end_before(&e, shard).filter(|_| resumed))
            {
                Some(o) => {
                    at = Some(StartPosition::Offset(Offset(o)));
                    moved = Some(o);
                }
                None => return Err(e),
            },
            r => return r.map(|s| (s, moved)),
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
        Some(o) => Some(StartPosition::Offset(Offset(o.saturating_add(1)))),
        None => start,
    }
}

/// Runs futures concurrently and collects their outputs in order.
pub(crate) async fn futures_join_all<F: std::future::Future>(
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
        cursor(CursorErrorReason::TooOld, requested, available)
    }

    fn cursor(reason: CursorErrorReason, requested: u64, available: u64) -> ClientError {
        ClientError::Cursor(SubscribeCursorError {
            reason,
            requested,
            available,
        })
    }

    fn coded(code: felix_wire::ErrorCode) -> ClientError {
        ClientError::Broker(crate::error::BrokerError {
            message: format!("{code:?}"),
            code: Some(code),
            retry: None,
            detail: None,
            context: "subscribe",
        })
    }

    fn gave_up(last: ClientError) -> ClientError {
        ClientError::GaveUp {
            attempts: 2,
            endpoints: 1,
            in_doubt: true,
            last: Box::new(last),
        }
    }

    /// What a lost shard does after a failed try to open it again. Before 2026-12-08
    /// it followed only a bare `too_old`, and tried again every 250 ms, forever, after
    /// anything else: after `in_future` (its log now ends before where it resumes,
    /// so the records written again at those offsets were skipped once it opened) and
    /// a credential failure.
    #[test]
    fn a_lost_shard_reopens_as_its_refusal_says() {
        use felix_wire::ErrorCode;
        let at = |e: &ClientError| reopen_after(e, None, 0);
        assert_eq!(at(&too_old(5, 10)), Reopen::At(10));
        assert_eq!(at(&gave_up(too_old(5, 10))), Reopen::At(10));
        let in_future = cursor(CursorErrorReason::InFuture, 20, 12);
        assert_eq!(at(&in_future), Reopen::At(12));
        assert_eq!(at(&gave_up(in_future)), Reopen::At(12));
        assert!(matches!(at(&coded(ErrorCode::Forbidden)), Reopen::Never(_)));
        let lost = ClientError::connection("127.0.0.1:1", "closed");
        assert_eq!(at(&lost), Reopen::Again);
        let refused = coded(ErrorCode::Unauthenticated);
        assert!(matches!(
            reopen_after(&lost, Some(&refused), 0),
            Reopen::Never(e) if e.contains("Unauthenticated")
        ));
        assert_eq!(reopen_after(&lost, Some(&lost), 0), Reopen::Again);
        let gone = coded(ErrorCode::NotFound);
        assert_eq!(at(&gone), Reopen::Again, "a new leader may not know it yet");
        assert_eq!(at(&coded(ErrorCode::Overloaded)), Reopen::Again);
    }

    /// Tries to open a lost shard again wait longer each time, up to a second, and at
    /// least half their ceiling.
    #[test]
    fn a_lost_shards_tries_back_off_to_a_second() {
        let ms = |tries, unit| recover_pause(tries, unit).as_millis();
        assert_eq!([ms(0, 0.0), ms(0, 0.999_999)], [125, 249]);
        assert_eq!([ms(1, 0.0), ms(2, 0.0), ms(3, 0.0)], [250, 500, 500]);
        assert_eq!(ms(u32::MAX, 1.0), 1000);
    }

    /// Where a shard's task rewound it (its log ended before it), the positions say so
    /// in its place among the events: taken after the records before and before the
    /// next one, they said the old offset, and a resume from them skipped what was
    /// written again at the offsets between.
    #[tokio::test]
    async fn positions_follow_a_rewound_shard_in_order() {
        let (tx, rx) = mpsc::channel(8);
        let mut sub = ShardedSubscription {
            rx,
            delivered: ShardOffsets::new(),
            shards: 1,
            tasks: Vec::new(),
        };
        let record = |offset| {
            Item::Event(ShardEvent::Record {
                shard: 0,
                event: Event {
                    tenant_id: "t".into(),
                    namespace: "n".into(),
                    stream: "s".into(),
                    payload: bytes::Bytes::new(),
                    offset: Some(offset),
                    skipped_before: 0,
                },
            })
        };
        for item in [
            record(19),
            Item::Rewound {
                shard: 0,
                before: Some(11),
            },
            Item::Event(ShardEvent::ShardRecovered { shard: 0 }),
            record(12),
            Item::Rewound {
                shard: 0,
                before: None,
            },
            Item::Event(ShardEvent::ShardRecovered { shard: 0 }),
        ] {
            tx.send(item).await.unwrap();
        }
        drop(tx);
        let mut seen = Vec::new();
        while sub.next().await.is_some() {
            seen.push(sub.positions().get(&0).copied());
        }
        assert_eq!(seen, [Some(19), Some(11), Some(12), None]);
    }

    /// A resume past the log's end (its tail lost with an old leader since the
    /// positions were taken) opens at the end, and says so; a start the caller named
    /// past the end is refused (it asked to skip what lies below it).
    #[tokio::test]
    async fn a_resume_past_the_logs_end_opens_at_the_end() {
        for resumed in [true, false] {
            let asked = std::cell::RefCell::new(Vec::new());
            let opened =
                open_past_retention(0, Some(StartPosition::Offset(Offset(20))), resumed, |at| {
                    let StartPosition::Offset(Offset(o)) = at.expect("a position") else {
                        panic!("{at:?}")
                    };
                    asked.borrow_mut().push(o);
                    std::future::ready(if o > 12 {
                        Err(cursor(CursorErrorReason::InFuture, o, 12))
                    } else {
                        Ok(o)
                    })
                })
                .await;
            if resumed {
                assert_eq!(opened.unwrap(), (12, Some(12)));
                assert_eq!(*asked.borrow(), [20, 12]);
            } else {
                assert!(matches!(opened, Err(ClientError::Cursor(_))), "{opened:?}");
                assert_eq!(*asked.borrow(), [20]);
            }
        }
    }

    /// A resume refused `too_old` after a try that timed out (wrapped in `GaveUp`)
    /// follows retention as a bare refusal does.
    #[tokio::test]
    async fn a_resume_follows_retention_through_a_retried_open() {
        let asked = std::cell::RefCell::new(Vec::new());
        let opened = open_past_retention(0, Some(StartPosition::Offset(Offset(1))), true, |at| {
            let StartPosition::Offset(Offset(o)) = at.expect("a position") else {
                panic!("{at:?}")
            };
            asked.borrow_mut().push(o);
            std::future::ready(if o < 10 {
                Err(gave_up(too_old(o, 10)))
            } else {
                Ok(o)
            })
        })
        .await
        .unwrap();
        assert_eq!(opened, (10, Some(10)));
        assert_eq!(*asked.borrow(), [1, 10]);
    }

    /// Retention removes the oldest record twice between a refusal naming it and the
    /// open at it: the resume follows the oldest each time and opens at the fourth try.
    #[tokio::test]
    async fn a_resume_follows_retention_that_runs_while_it_opens() {
        let oldest = std::cell::Cell::new(10);
        let asked = std::cell::RefCell::new(Vec::new());
        let opened = open_past_retention(0, Some(StartPosition::Offset(Offset(1))), true, |at| {
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
        assert_eq!(opened, (20, Some(20)));
        assert_eq!(*asked.borrow(), [1, 10, 15, 20]);
    }

    /// Another refusal is the caller's at once; a resume that retention outruns gives up
    /// after its bound with the last refusal.
    #[tokio::test]
    async fn a_resume_gives_up_on_other_errors_and_past_its_bound() {
        let mut asked = 0;
        let r: Result<(u64, _), _> = open_past_retention(0, None, true, |_| {
            asked += 1;
            std::future::ready(Err(ClientError::Protocol("no".into())))
        })
        .await;
        assert!(matches!(r, Err(ClientError::Protocol(_))), "{r:?}");
        assert_eq!(asked, 1);
        let mut asked = 0;
        let r: Result<(u64, _), _> = open_past_retention(0, None, true, |_| {
            asked += 1;
            std::future::ready(Err(too_old(0, asked)))
        })
        .await;
        assert!(matches!(r, Err(ClientError::Cursor(_))), "{r:?}");
        assert_eq!(asked, RETAINED_OPENS_MAX as u64);
    }
}
