//! The idempotent producer: batches numbered per shard, re-sent under the same number
//! until the broker answers, so a retry after a lost answer, a dead connection or a
//! failover lands once.

use std::collections::HashMap;

use bytes::Bytes;
use tokio::sync::Mutex;

use crate::cluster::ClusterClient;
use crate::error::ClientError;

/// One shard's sequence.
#[derive(Debug, Default)]
struct ShardSeq {
    /// The next batch's sequence.
    next: u64,
    /// The last batch sent whose outcome is unknown: the next call must re-send it.
    in_doubt: Option<Vec<Bytes>>,
    /// A typed refusal ended the producer on this shard.
    ended: Option<String>,
}

/// An idempotent producer (`ClusterClient::idempotent_producer`).
///
/// Each batch carries `(producer_id, sequence)`, the sequence counting batches per
/// shard from 0 and advancing only on `publish_ok`. A failure that leaves the outcome
/// unknown is retried under the same sequence by the cluster client's policy; if it
/// still fails, the batch is *in doubt* and the next call on that shard must be the same
/// batch (anything else is refused locally, unsent); so is a batch whose call was
/// dropped before its answer (it may have landed). A typed refusal (`Refused`: a gap,
/// an unknown or expired producer) ends the producer on that shard; a `not_leader`
/// refusal is followed to the owner it names, as the protocol asks, never surfaced. Batches go one at a
/// time per producer (no pipelining).
#[derive(Debug)]
pub struct IdempotentProducer<'a> {
    cluster: &'a ClusterClient,
    id: u64,
    shards: Mutex<HashMap<(String, String, String, u32), ShardSeq>>,
}

impl ClusterClient {
    /// A new idempotent producer, its id chosen by a broker.
    pub async fn idempotent_producer(&self) -> Result<IdempotentProducer<'_>, ClientError> {
        let id = self
            .with_retry(crate::cluster::Resend::Always, |c| async move {
                c.producer_init().await
            })
            .await?;
        Ok(IdempotentProducer {
            cluster: self,
            id,
            shards: Mutex::default(),
        })
    }
}

impl IdempotentProducer<'_> {
    /// The producer's id.
    pub fn producer_id(&self) -> u64 {
        self.id
    }

    /// Publishes one record to shard 0 of the stream; returns its offset.
    pub async fn publish(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        payload: Vec<u8>,
    ) -> Result<u64, ClientError> {
        self.publish_batch(tenant, namespace, stream, 0, vec![Bytes::from(payload)])
            .await
    }

    /// Publishes a batch to `shard`; returns its first offset. Lands once however often
    /// it is re-sent.
    pub async fn publish_batch(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        payloads: Vec<Bytes>,
    ) -> Result<u64, ClientError> {
        let mut shards = self.shards.lock().await;
        let seq = shards
            .entry((tenant.into(), namespace.into(), stream.into(), shard))
            .or_default();
        if let Some(why) = &seq.ended {
            return Err(ClientError::Config(format!(
                "this producer ended on {tenant}/{namespace}/{stream}/{shard}: {why}"
            )));
        }
        if seq
            .in_doubt
            .as_ref()
            .is_some_and(|previous| *previous != payloads)
        {
            return Err(ClientError::Config(
                "the previous batch's outcome is unknown: re-send that batch first".into(),
            ));
        }
        let sequence = seq.next;
        // In doubt from before it is sent until it is answered: a call dropped part way
        // (a timeout around it) may have landed, and the next batch must not go out
        // under its sequence (the broker would refuse it `sequence_reused` and end the
        // producer on this shard).
        seq.in_doubt = Some(payloads.clone());
        let result = self
            .cluster
            .with_retry(crate::cluster::Resend::Always, |_| {
                // A `not_leader` refusal is followed to the owner it names.
                let payloads = &payloads;
                async move {
                    self.cluster
                        .on_owner(|c| async move {
                            c.publish_idempotent(
                                tenant,
                                namespace,
                                stream,
                                Some(shard),
                                payloads.clone(),
                                self.id,
                                sequence,
                            )
                            .await
                        })
                        .await
                        .map(|(_, offset)| offset)
                }
            })
            .await;
        match &result {
            Ok(_) => {
                seq.next += 1;
                seq.in_doubt = None;
            }
            // (After an attempt whose outcome was unknown the refusal comes wrapped in
            // `GaveUp`: the broker's answer about the sequence decides all the same.)
            Err(e) if e.refusal().is_some() => {
                seq.ended = e.refusal().map(|reason| format!("{reason:?}"));
                seq.in_doubt = None;
            }
            // Refused before it was sent (too large): nothing of it can have landed.
            Err(ClientError::Config(_)) => seq.in_doubt = None,
            Err(_) => seq.in_doubt = Some(payloads),
        }
        result
    }
}
