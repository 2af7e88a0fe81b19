//! `felix-client`: the Felix SDK for tokio.
//!
//! [`Client`] talks to one broker; [`ClusterClient`] owns a `Client` and rebuilds it from
//! the other endpoints when the one in use fails, discovers brokers, follows redirects,
//! retries by the broker's retry class with full-jitter backoff, and reads whole
//! multi-shard streams ([`ClusterClient::subscribe_sharded`]).
//!
//! A call may be dropped part way (a timeout around it, a cancelled task): its answer is
//! never taken by the next call on the same client. (Calls share one request stream; a
//! dropped call's stream is dropped with it and the next call opens a fresh one, and an
//! answer carrying another call's request id is refused as a protocol error.) Whether a
//! dropped write was applied is unknown, as with any lost answer.
//!
//! Connecting to a cluster (the multi-node client guide's example, as written):
//!
//! ```no_run
//! use std::time::Duration;
//! use felix_client::{ClientConfig, ClusterClient, ReconnectPolicy};
//! use felix_wire::AckMode;
//!
//! # async fn example(quinn: quinn::ClientConfig) -> anyhow::Result<()> {
//! let mut config = ClientConfig::from_env_or_yaml(quinn, None)?;
//! config.auth_tenant_id = Some("acme".to_string());
//! config.auth_token = Some(std::env::var("FELIX_TOKEN")?);
//!
//! // Every broker you know of. One is enough — see "Discovery" below.
//! let seeds = ["10.0.0.4:5000".parse()?, "10.0.0.5:5000".parse()?];
//!
//! let client = ClusterClient::connect_with_policy(
//!     &seeds,
//!     "broker.internal",
//!     config,
//!     ReconnectPolicy {
//!         attempts: 5,
//!         backoff: Duration::from_millis(200),
//!         max_backoff: Duration::from_secs(2),
//!         // Off by default. See "Retries" for why there is no useful default.
//!         deadline: Some(Duration::from_secs(10)),
//!     },
//! )
//! .await?;
//!
//! client
//!     .publish_at_least_once("acme", "default", "orders", b"payload".to_vec(), AckMode::PerMessage)
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! Consuming a whole multi-shard stream (the guide's example, with the two kinds the
//! standard SDK added after it: `ShardMoved` and `StreamDeleted`):
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use std::net::SocketAddr;
//! # use felix_client::{ClientConfig, ClusterClient, ShardEvent, StartPosition};
//! # use tracing::{info, warn};
//! # fn handle(_shard: u32, _event: felix_client::Event) {}
//! # async fn example(seeds: Vec<SocketAddr>, config: ClientConfig) -> anyhow::Result<()> {
//! let client = Arc::new(ClusterClient::connect(&seeds, "localhost", config).await?);
//! let mut subscription = client
//!     .subscribe_sharded("t1", "default", "orders", Some(StartPosition::Earliest))
//!     .await?;
//!
//! while let Some(item) = subscription.next().await {
//!     match item {
//!         ShardEvent::Record { shard, event } => handle(shard, event),
//!         // Not an error and not silence: this shard is down and being
//!         // re-established, and the others are still delivering (unless a
//!         // credential failure ended it: then this is the shard's last event).
//!         ShardEvent::ShardLost { shard, error } => warn!(shard, %error, "shard down"),
//!         ShardEvent::ShardRecovered { shard } => info!(shard, "shard back"),
//!         // A planned move: followed at once, nothing missed.
//!         ShardEvent::ShardMoved { shard, node_id, .. } => info!(shard, ?node_id, "shard moved"),
//!         ShardEvent::StreamDeleted { shard } => warn!(shard, "stream deleted"),
//!     }
//! }
//! # Ok(())
//! # }
//! ```

pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod error;
pub mod groups;
pub mod idempotent;
pub mod ops;
pub mod retry;
pub mod sharded;
pub mod watch;

pub use client::{Client, Event, Negotiated, Subscription, SubscriptionEnd};
pub use cluster::ClusterClient;
pub use config::{ClientConfig, TokenProvider, quic_client_config, quic_client_config_from_file};
pub use error::{BrokerError, ClientError, NotLeaderError, SubscribeCursorError};
pub use felix_wire::message::GroupRecord;
pub use felix_wire::message::{BrokerEndpoint, CursorErrorReason, StartPosition};
pub use felix_wire::{AckMode, ErrorCode, ErrorDetail, RetryClass, ShardRouting};
pub use groups::{GroupInfo, GroupRef, PollOptions};
pub use idempotent::IdempotentProducer;
pub use retry::ReconnectPolicy;
pub use sharded::{ShardEvent, ShardOffsets, ShardedSubscription};
pub use watch::{CacheChange, CacheWatch, CacheWatchFilter, CacheWatchStart};
