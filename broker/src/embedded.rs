//! `felix-broker dev` with the control plane embedded in the same process.
//!
//! The dev broker is the whole cluster, so it leads every shard and routes nothing; the
//! embedded control plane (in-memory store) gives it the same management API a real
//! cluster has: `felix stream create|list`, tenants, tokens. The two are kept in step:
//! the store is wrapped so a stream or cache created through the API is in the broker's
//! catalog before the API answers (and refused if the broker already made one of that
//! name with another shape); a mirror thread lists streams the broker auto-created on
//! first use in the API, and installs the keys of tenants created through the API.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use felix_controlplane::client::{ClientError, ControlPlaneClient};
use felix_controlplane::server::{self, ServerConfig};
use felix_controlplane::store::{BoxFut, Change, Doc, Kind, MemoryStore, Op, Store, StoreError};
use serde_json::json;

use crate::catalog::StreamSpec;
use crate::core::Shared;

/// The embedded control plane.
#[derive(Debug)]
pub struct Embedded {
    /// Its URL.
    pub url: String,
    /// The operator admin token, written for the `felix` tool.
    pub token_path: PathBuf,
}

fn random_hex(bytes: usize) -> anyhow::Result<String> {
    let mut buf = vec![0u8; bytes];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut buf)
        .map_err(|_| anyhow::anyhow!("no system randomness"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn ok_or_exists(r: Result<serde_json::Value, ClientError>) -> Result<(), ClientError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.status() == Some(409) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Starts the control plane on `listen` (its own thread and tokio runtime), bootstraps
/// it, creates `tenant` with namespace `default`, and starts the mirror.
pub fn start(
    listen: SocketAddr,
    data_dir: &Path,
    tenant: &str,
    shared: Arc<Shared>,
) -> anyhow::Result<Embedded> {
    let bootstrap = random_hex(24)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let store_shared = shared.clone();
    let config = ServerConfig {
        listen,
        api: felix_controlplane::api::ApiConfig {
            bootstrap_token: Some(bootstrap.clone()),
            ..Default::default()
        },
        ..ServerConfig::default()
    };
    std::thread::Builder::new()
        .name("felix-controlplane".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(anyhow::anyhow!("control-plane runtime: {e}")));
                    return;
                }
            };
            rt.block_on(async move {
                let store = Arc::new(CatalogStore {
                    inner: MemoryStore::new(),
                    shared: store_shared,
                });
                match server::start_with_store(config, store).await {
                    Ok(running) => {
                        let _ = tx.send(Ok(running.addr));
                        // Serves until the process exits.
                        std::future::pending::<()>().await;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            });
        })?;
    let addr = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| anyhow::anyhow!("the embedded control plane did not start"))??;
    let url = format!("http://{addr}");
    let anon = ControlPlaneClient::new(&url, None)?;
    let boot = anon.post_with(
        "/internal/bootstrap",
        &json!({"principal": "dev"}),
        &[("X-Felix-Bootstrap-Token", &bootstrap)],
    )?;
    let token = boot["token"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("bootstrap answered without a token"))?
        .to_owned();
    let admin = anon.with_token(token.clone());
    ok_or_exists(admin.post(
        "/v1/tenants",
        &json!({"tenant_id": tenant, "display_name": "dev"}),
    ))?;
    ok_or_exists(admin.post(
        &format!("/v1/tenants/{tenant}/namespaces"),
        &json!({"namespace": "default"}),
    ))?;
    let token_path = data_dir.join("dev/controlplane.token");
    crate::dev::write_private(&token_path, token.as_bytes())?;
    std::thread::Builder::new()
        .name("felix-cp-mirror".into())
        .spawn(move || {
            let base = (**shared.keys.load()).clone();
            let mut mirrored = std::collections::HashSet::new();
            loop {
                if let Err(e) = mirror_once(&admin, &shared, &base, &mut mirrored) {
                    tracing::warn!(error = %e, "mirroring the embedded control plane");
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        })?;
    Ok(Embedded { url, token_path })
}

/// The in-memory store, writing stream and cache creations through to the broker's
/// catalog.
#[derive(Debug)]
struct CatalogStore {
    inner: MemoryStore,
    shared: Arc<Shared>,
}

fn shape_of(kind: Kind, value: &serde_json::Value) -> Option<(bool, Shape)> {
    let stream = match kind {
        Kind::Stream => true,
        Kind::Cache => false,
        _ => return None,
    };
    Some((stream, serde_json::from_value(value.clone()).ok()?))
}

impl Store for CatalogStore {
    fn get<'a>(&'a self, kind: Kind, key: &'a str) -> BoxFut<'a, Option<Doc>> {
        self.inner.get(kind, key)
    }

    fn list<'a>(&'a self, kind: Kind, prefix: &'a str) -> BoxFut<'a, Vec<Doc>> {
        self.inner.list(kind, prefix)
    }

    fn batch(&self, ops: Vec<Op>) -> BoxFut<'_, Vec<Doc>> {
        Box::pin(async move {
            let created: Vec<(bool, Shape)> = ops
                .iter()
                .filter_map(|op| match op {
                    Op::Put { kind, value, .. } => shape_of(*kind, value),
                    Op::Delete { .. } => None,
                })
                .collect();
            let deleted: Vec<(bool, String)> = ops
                .iter()
                .filter_map(|op| match op {
                    Op::Delete {
                        kind: Kind::Stream,
                        key,
                        ..
                    } => Some((true, key.clone())),
                    Op::Delete {
                        kind: Kind::Cache,
                        key,
                        ..
                    } => Some((false, key.clone())),
                    _ => None,
                })
                .collect();
            let catalog = &self.shared.catalog;
            for (stream, s) in &created {
                // A name being deleted is free again only once its data is gone.
                let mut waited = 0;
                while catalog.is_deleting(*stream, &s.tenant_id, &s.namespace, &s.stream) {
                    if waited >= DELETION_WAIT_MS {
                        return Err(StoreError::Conflict {
                            kind: if *stream { "stream" } else { "cache" },
                            key: format!("{}/{}/{}", s.tenant_id, s.namespace, s.stream),
                            reason: "its previous data is still being deleted; retry".into(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    waited += 20;
                }
                if let Some(have) = catalog.spec(*stream, &s.tenant_id, &s.namespace, &s.stream)
                    && (have.shards != s.shards || have.routing != s.routing)
                {
                    return Err(StoreError::Conflict {
                        kind: if *stream { "stream" } else { "cache" },
                        key: format!("{}/{}/{}", s.tenant_id, s.namespace, s.stream),
                        reason: format!(
                            "the dev broker already has it with {} shards",
                            have.shards
                        ),
                    });
                }
            }
            let written = self.inner.batch(ops).await?;
            for (stream, s) in created {
                // The dev broker is one node: it keeps one copy whatever the API says.
                let spec = StreamSpec {
                    routing: s.routing,
                    retention: s.retention,
                    ..StreamSpec::new(s.shards)
                };
                let r = if stream {
                    catalog.create_stream(&s.tenant_id, &s.namespace, &s.stream, spec)
                } else {
                    catalog.create_cache(&s.tenant_id, &s.namespace, &s.stream, spec)
                };
                if let Err(e) = r {
                    tracing::warn!(error = %e, "writing an API-created stream to the dev catalog");
                }
            }
            for (stream, key) in deleted {
                let mut parts = key.splitn(3, '/');
                if let (Some(t), Some(ns), Some(n)) = (parts.next(), parts.next(), parts.next()) {
                    catalog.delete(stream, t, ns, n);
                }
            }
            let c = catalog.clone();
            match tokio::task::spawn_blocking(move || c.persist()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "persisting the dev catalog"),
                Err(e) => tracing::error!(error = %e, "persisting the dev catalog"),
            }
            Ok(written)
        })
    }

    fn changes(
        &self,
        kind: Kind,
        since: u64,
        limit: usize,
        wait: Duration,
    ) -> BoxFut<'_, (Vec<Change>, u64)> {
        self.inner.changes(kind, since, limit, wait)
    }

    fn head(&self) -> BoxFut<'_, u64> {
        self.inner.head()
    }

    fn trimmed(&self) -> BoxFut<'_, u64> {
        self.inner.trimmed()
    }

    fn ping(&self) -> BoxFut<'_, ()> {
        self.inner.ping()
    }
}

#[derive(serde::Deserialize)]
struct Shape {
    tenant_id: String,
    namespace: String,
    #[serde(alias = "cache")]
    stream: String,
    shards: u32,
    #[serde(default)]
    routing: felix_wire::routing::ShardRouting,
    #[serde(default)]
    retention: crate::catalog::Retention,
}

/// How long creating a name waits for the deletion of its previous data.
const DELETION_WAIT_MS: u64 = 5_000;

/// One pass of the mirror. `mirrored` remembers every name already known to the API,
/// so a stream deleted through the API is never listed again by a stale pass.
fn mirror_once(
    admin: &ControlPlaneClient,
    shared: &Shared,
    base: &crate::auth::TenantKeys,
    mirrored: &mut std::collections::HashSet<String>,
) -> anyhow::Result<()> {
    let snapshot = admin.get("/v1/streams/snapshot")?;
    let streams: Vec<Shape> = serde_json::from_value(snapshot["items"].clone())?;
    for s in &streams {
        mirrored.insert(format!("{}/{}/{}", s.tenant_id, s.namespace, s.stream));
    }
    // Broker -> API: streams auto-created on first use.
    for (name, spec) in shared.catalog.streams() {
        if !mirrored.insert(name.clone()) {
            continue;
        }
        let mut parts = name.splitn(3, '/');
        let (Some(t), Some(ns), Some(s)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if streams
            .iter()
            .any(|x| x.tenant_id == t && x.namespace == ns && x.stream == s)
        {
            continue;
        }
        ok_or_exists(admin.post("/v1/tenants", &json!({"tenant_id": t})))?;
        ok_or_exists(admin.post(
            &format!("/v1/tenants/{t}/namespaces"),
            &json!({"namespace": ns}),
        ))?;
        let routing = serde_json::to_value(spec.routing)?;
        ok_or_exists(admin.post(
            &format!("/v1/tenants/{t}/namespaces/{ns}/streams"),
            &json!({"stream": s, "kind": "Stream", "shards": spec.shards, "routing": routing}),
        ))?;
    }
    // Keys of tenants made through the API.
    let (keys, _) = crate::cluster::fetch_keys(admin, base, &shared.keys.load())?;
    if **shared.keys.load() != keys {
        shared.keys.store(Arc::new(keys));
    }
    Ok(())
}
