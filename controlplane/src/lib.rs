//! The Felix control plane: a conventional tokio REST service that owns tenants,
//! namespaces, streams, caches, the node catalog and shard assignments. It is never on
//! the data path: brokers register, heartbeat, and follow the assignment feed.
//!
//! - [`store`]: the metadata store trait and the in-memory store; [`pg`]: Postgres.
//! - [`api`]: the REST API with token authentication and RBAC on every endpoint.
//! - [`placement`]: the timed pass that assigns shards to ready nodes and promotes
//!   successors; [`replication`]: the replica reports it judges them by.
//! - [`server`]: wiring it together; [`config`]: the binary's settings; [`bounded`]:
//!   serving HTTP with bounds on connections and request heads; [`limits`]: what one
//!   tenant and the cluster may hold of what brokers read whole.
//! - [`client`]: a blocking client brokers and the `felix` tool use; with default
//!   features off, the crate is only this and [`model`].

pub mod client;
#[cfg(feature = "server")]
pub mod limits;
pub mod model;

#[cfg(feature = "server")]
pub mod api;
#[cfg(feature = "server")]
pub mod bounded;
#[cfg(feature = "server")]
pub mod cli;
#[cfg(feature = "server")]
pub mod config;
#[cfg(feature = "server")]
pub mod pg;
#[cfg(feature = "server")]
pub mod pg_tls;
#[cfg(feature = "server")]
pub mod placement;
#[cfg(feature = "server")]
pub mod replication;
#[cfg(feature = "server")]
pub mod sealing;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "server")]
pub mod store;
#[cfg(feature = "server")]
pub mod tls;
