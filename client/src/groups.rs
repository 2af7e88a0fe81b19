//! Consumer groups (queues) on one stream shard: claim records, settle them, look after
//! the ones given up on. Each request travels on a stream of its own, so a poll that
//! waits for records holds up nothing else on the connection.

use std::time::Duration;

use felix_wire::message::{GroupRecord, StartPosition};
use felix_wire::{Features, Message, Offset, RequestId, ShardId};

use crate::client::{Client, broker_error};
use crate::error::ClientError;

/// A group on one shard of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRef {
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// Group name (1-128 bytes).
    pub group: String,
}

impl GroupRef {
    /// The group `group` on `shard` of `tenant/namespace/stream`.
    pub fn new(tenant: &str, namespace: &str, stream: &str, shard: u32, group: &str) -> Self {
        GroupRef {
            tenant: tenant.into(),
            namespace: namespace.into(),
            stream: stream.into(),
            shard,
            group: group.into(),
        }
    }
}

/// How a poll claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollOptions {
    /// Records at most (the broker caps one poll at 1000).
    pub max_records: u32,
    /// How long the broker may hold the poll open waiting for records (at most 30 s).
    pub wait: Duration,
    /// How long the claims hold; `None` for the broker's default.
    pub visibility: Option<Duration>,
}

impl Default for PollOptions {
    fn default() -> Self {
        PollOptions {
            max_records: 32,
            wait: Duration::from_secs(5),
            visibility: None,
        }
    }
}

/// A group's state, from `group_describe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupInfo {
    /// Every offset below it is finished; `None` when the group does not exist.
    pub committed: Option<u64>,
    /// The shard's tail.
    pub tail: u64,
    /// Records claimed now.
    pub in_flight: u64,
    /// Records owed again (lapsed, nacked, redriven).
    pub owed: u64,
    /// Dead letters.
    pub dead_letters: u64,
}

impl GroupInfo {
    /// Records not yet finished by the group.
    pub fn lag(&self) -> u64 {
        self.tail.saturating_sub(self.committed.unwrap_or(0))
    }
}

impl Client {
    fn group_message(
        &self,
        g: &GroupRef,
        make: impl FnOnce(String, String, String, ShardId, String, RequestId) -> Message,
    ) -> Message {
        make(
            g.tenant.clone(),
            g.namespace.clone(),
            g.stream.clone(),
            ShardId(g.shard),
            g.group.clone(),
            RequestId(self.next_id()),
        )
    }

    async fn group_call(
        &self,
        m: Message,
        context: &'static str,
        wait: Duration,
    ) -> Result<Message, ClientError> {
        self.request_on_own_stream(m, context, wait).await
    }

    /// Claims records for the group. An empty answer means nothing was unclaimed within
    /// `wait`: an answer, not an error.
    pub async fn group_poll(
        &self,
        g: &GroupRef,
        options: PollOptions,
    ) -> Result<Vec<GroupRecord>, ClientError> {
        self.poll_as(g, options, None, false).await
    }

    /// Claims records as the named member `consumer` (1-128 bytes; needs a broker with
    /// named members): the claims are its own, and with `reclaim` the broker first hands
    /// back the records this member still holds claimed (a consumer that restarted
    /// picks up its claims at once, on the same attempt, instead of waiting out their
    /// visibility), then claims more.
    pub async fn group_poll_as(
        &self,
        g: &GroupRef,
        options: PollOptions,
        consumer: &str,
        reclaim: bool,
    ) -> Result<Vec<GroupRecord>, ClientError> {
        self.require(Features::GROUP_CONSUMER, "group_poll with a consumer")?;
        self.poll_as(g, options, Some(consumer.to_owned()), reclaim)
            .await
    }

    async fn poll_as(
        &self,
        g: &GroupRef,
        options: PollOptions,
        consumer: Option<String>,
        reclaim: bool,
    ) -> Result<Vec<GroupRecord>, ClientError> {
        self.require(Features::CONSUMER_GROUP, "group_poll")?;
        if options.visibility.is_some() {
            // A broker without it would ignore the field and use its own visibility.
            self.require(
                Features::GROUP_CLAIM_CONTROL,
                "group_poll with a visibility",
            )?;
        }
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupPoll {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                max_records: options.max_records.max(1),
                wait_ms: options.wait.as_millis() as u64,
                request_id: rid,
                consumer,
                reclaim,
                visibility_ms: options.visibility.map(|v| (v.as_millis() as u64).max(1)),
            }
        });
        match self.group_call(m, "group_poll", options.wait).await? {
            Message::GroupRecords { records, .. } => Ok(records),
            other => Err(broker_error("group_poll", other)),
        }
    }

    async fn group_settle(&self, m: Message, context: &'static str) -> Result<(), ClientError> {
        match self.group_call(m, context, Duration::ZERO).await? {
            Message::CacheOk { .. } => Ok(()),
            other => Err(broker_error(context, other)),
        }
    }

    /// Finishes a record. Durable before it returns.
    pub async fn group_ack(&self, g: &GroupRef, offset: u64) -> Result<(), ClientError> {
        self.require(Features::CONSUMER_GROUP, "group_ack")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupAck {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                offset: Offset(offset),
                request_id: rid,
            }
        });
        self.group_settle(m, "group_ack").await
    }

    /// Hands a claimed record back, owed again after `delay` (zero: at once).
    /// `attempts` is the delivery's (its [`GroupRecord`]'s `attempts`): the broker then
    /// hands back only that delivery's claim, and answers `claim_gone` once it lapsed
    /// and went to another consumer. Without it (0), or to a broker that does not
    /// serve `GROUP_CLAIM_CONTROL` (where it is not sent), the nack takes back
    /// whichever claim holds the record now, another consumer's included, and spends
    /// one of its attempts.
    pub async fn group_nack(
        &self,
        g: &GroupRef,
        offset: u64,
        attempts: u32,
        delay: Duration,
    ) -> Result<(), ClientError> {
        self.require(Features::CONSUMER_GROUP, "group_nack")?;
        if !delay.is_zero() {
            self.require(Features::GROUP_CLAIM_CONTROL, "group_nack with a delay")?;
        }
        let named = self.require(Features::GROUP_CLAIM_CONTROL, "").is_ok();
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupNack {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                offset: Offset(offset),
                request_id: rid,
                delay_ms: (!delay.is_zero()).then_some(delay.as_millis() as u64),
                attempts: (named && attempts != 0).then_some(attempts),
            }
        });
        self.group_settle(m, "group_nack").await
    }

    /// Gives up on a claimed record: it becomes a dead letter.
    pub async fn group_dead_letter(&self, g: &GroupRef, offset: u64) -> Result<(), ClientError> {
        self.require(Features::GROUP_CLAIM_CONTROL, "group_dead_letter")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupDeadLetter {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                offset: Offset(offset),
                request_id: rid,
            }
        });
        self.group_settle(m, "group_dead_letter").await
    }

    /// The group's dead letters, lowest first (offsets into the log, not copies).
    pub async fn group_dead_letters(&self, g: &GroupRef) -> Result<Vec<u64>, ClientError> {
        self.require(Features::GROUP_DEAD_LETTERS, "group_dead_letters")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupDeadLetters {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                request_id: rid,
            }
        });
        match self
            .group_call(m, "group_dead_letters", Duration::ZERO)
            .await?
        {
            Message::GroupDeadLetterList { offsets, .. } => {
                Ok(offsets.into_iter().map(|o| o.0).collect())
            }
            other => Err(broker_error("group_dead_letters", other)),
        }
    }

    /// Puts a dead letter back in the queue, its attempts reset. Durable before it
    /// returns.
    pub async fn group_redrive(&self, g: &GroupRef, offset: u64) -> Result<(), ClientError> {
        self.require(Features::GROUP_DEAD_LETTERS, "group_redrive")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupRedrive {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                offset: Offset(offset),
                request_id: rid,
            }
        });
        self.group_settle(m, "group_redrive").await
    }

    /// Drops a dead letter from the list; the record stays finished.
    pub async fn group_discard(&self, g: &GroupRef, offset: u64) -> Result<(), ClientError> {
        self.require(Features::GROUP_DEAD_LETTERS, "group_discard")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupDiscard {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                offset: Offset(offset),
                request_id: rid,
            }
        });
        self.group_settle(m, "group_discard").await
    }

    /// Places the group's cursor (creating the group); with `if_new`, only a group that
    /// does not exist yet. Returns the cursor and whether it moved.
    pub async fn group_seek(
        &self,
        g: &GroupRef,
        start: StartPosition,
        if_new: bool,
    ) -> Result<(u64, bool), ClientError> {
        self.require(Features::GROUP_ADMIN, "group_seek")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupSeek {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                start,
                if_new,
                request_id: rid,
            }
        });
        match self.group_call(m, "group_seek", Duration::ZERO).await? {
            Message::GroupPosition { offset, moved, .. } => Ok((offset.0, moved)),
            other => Err(broker_error("group_seek", other)),
        }
    }

    /// The group's cursor and counts.
    pub async fn group_describe(&self, g: &GroupRef) -> Result<GroupInfo, ClientError> {
        self.require(Features::GROUP_ADMIN, "group_describe")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupDescribe {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                request_id: rid,
            }
        });
        match self.group_call(m, "group_describe", Duration::ZERO).await? {
            Message::GroupInfo {
                committed,
                tail,
                in_flight,
                owed,
                dead_letters,
                ..
            } => Ok(GroupInfo {
                committed: committed.map(|o| o.0),
                tail: tail.0,
                in_flight,
                owed,
                dead_letters,
            }),
            other => Err(broker_error("group_describe", other)),
        }
    }

    /// Deletes the group; whether it existed.
    pub async fn group_delete(&self, g: &GroupRef) -> Result<bool, ClientError> {
        self.require(Features::GROUP_ADMIN, "group_delete")?;
        let m = self.group_message(g, |tenant_id, namespace, stream, shard, group, rid| {
            Message::GroupDelete {
                tenant_id,
                namespace,
                stream,
                shard,
                group,
                request_id: rid,
            }
        });
        match self.group_call(m, "group_delete", Duration::ZERO).await? {
            Message::GroupDeleted { existed, .. } => Ok(existed),
            other => Err(broker_error("group_delete", other)),
        }
    }
}
