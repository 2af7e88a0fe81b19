//! A control plane and N brokers as processes, on loopback, with their own data
//! directories and ports that survive restarts: what the multi-node tests drive.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use felix_controlplane::client::ControlPlaneClient;
use serde_json::{Value, json};

use crate::proxy::{Party, Rules};
use crate::{BrokerProcess, ClusterCerts, ControlPlaneProcess, free_udp_addr, wait_for};

/// The bootstrap secret the harness's control plane starts with.
pub const BOOTSTRAP: &str = "cluster-test-bootstrap-token";
/// The tenant and namespace streams are made in.
pub const TENANT: &str = "acme";
/// The namespace.
pub const NAMESPACE: &str = "payments";

/// Timings of the harness's control plane: heartbeats every 200 ms, a lease of
/// 1.5 s x 3/4, a broker declared down 1.875 s after its last heartbeat.
pub const CP_ARGS: &[&str] = &[
    "--heartbeat-interval-ms",
    "200",
    "--expiry-timeout-ms",
    "1500",
    "--placement-interval-ms",
    "200",
];

/// A running cluster.
#[derive(Debug)]
pub struct TestCluster {
    /// Where everything lives.
    pub dir: tempfile::TempDir,
    /// The control plane.
    pub cp: ControlPlaneProcess,
    /// An operator client.
    pub admin: ControlPlaneClient,
    /// TLS material.
    pub certs: ClusterCerts,
    /// The brokers, `node-0` ..
    pub brokers: Vec<BrokerProcess>,
    /// A client token with every data permission on the tenant.
    pub client_token: String,
    /// The link proxies, when started with them.
    pub net: Option<Net>,
}

/// Proxies on every link (see [`crate::proxy`]): clients reach `node-i` through
/// `client_fronts[i]`, peers reach it through its internal front, and it reaches the
/// control plane through its own TCP proxy.
#[derive(Debug)]
pub struct Net {
    /// The runtime the proxies run on.
    pub runtime: tokio::runtime::Runtime,
    /// The link rules.
    pub rules: Arc<Rules>,
    /// Where clients reach each broker.
    pub client_fronts: Vec<SocketAddr>,
}

fn token(admin: &ControlPlaneClient, tenant: &str, body: Value) -> anyhow::Result<String> {
    Ok(
        admin.post(&format!("/v1/tenants/{tenant}/tokens"), &body)?["token"]
            .as_str()
            .context("a token")?
            .to_owned(),
    )
}

impl TestCluster {
    /// Starts a control plane (with `cp_args` after the bootstrap token) and `nodes`
    /// brokers (binary `broker`), each with a broker-to-broker listener; `extra_yaml`
    /// is appended to every broker's config.
    pub fn start(
        broker: &Path,
        controlplane: &Path,
        nodes: usize,
        cp_args: &[&str],
        extra_yaml: &str,
    ) -> anyhow::Result<TestCluster> {
        Self::start_inner(broker, controlplane, nodes, cp_args, extra_yaml, false)
    }

    /// As [`TestCluster::start`], with every link behind a proxy ([`TestCluster::net`]).
    pub fn start_with_proxies(
        broker: &Path,
        controlplane: &Path,
        nodes: usize,
        cp_args: &[&str],
        extra_yaml: &str,
    ) -> anyhow::Result<TestCluster> {
        Self::start_inner(broker, controlplane, nodes, cp_args, extra_yaml, true)
    }

    fn start_inner(
        broker: &Path,
        controlplane: &Path,
        nodes: usize,
        cp_args: &[&str],
        extra_yaml: &str,
        proxies: bool,
    ) -> anyhow::Result<TestCluster> {
        let mut net = if proxies {
            Some(Net {
                runtime: tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()?,
                rules: Arc::default(),
                client_fronts: Vec::new(),
            })
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("felix-cluster")
            .tempdir_in("/var/tmp")?;
        let mut args = vec!["--bootstrap-token", BOOTSTRAP];
        args.extend_from_slice(cp_args);
        let cp = ControlPlaneProcess::start(controlplane, &args)?;
        let anon = ControlPlaneClient::new(&cp.url, None)?;
        let boot = anon.post_with(
            "/internal/bootstrap",
            &json!({}),
            &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
        )?;
        let admin = anon.with_token(boot["token"].as_str().context("an admin token")?);
        admin.post("/v1/tenants", &json!({"tenant_id": TENANT}))?;
        admin.post(
            &format!("/v1/tenants/{TENANT}/namespaces"),
            &json!({"namespace": NAMESPACE}),
        )?;
        let client_token = token(
            &admin,
            TENANT,
            json!({"sub": "app", "audience": "felix-broker", "perms": felix_wire::token::all_data_perms(TENANT)}),
        )?;
        let certs = ClusterCerts::write(dir.path())?;
        let mut brokers = Vec::new();
        for i in 0..nodes {
            let node = format!("node-{i}");
            let node_token = token(
                &admin,
                "operator",
                json!({"sub": node, "audience": "felix-controlplane", "perms": [format!("node.manage:node:{node}"), "node.view:cluster:*"]}),
            )?;
            let listen = free_udp_addr()?;
            let (internal, mut fronts, cp_url) = match &mut net {
                None => (free_udp_addr()?, String::new(), cp.url.clone()),
                Some(net) => {
                    let internal = crate::free_udp_addr_on(Party::node_ip(i))?;
                    let cp_addr: SocketAddr = cp
                        .url
                        .trim_start_matches("http://")
                        .trim_end_matches('/')
                        .parse()?;
                    let rules = net.rules.clone();
                    let (client_front, internal_front, cp_front) =
                        net.runtime.block_on(async move {
                            anyhow::Ok((
                                crate::proxy::udp(Party::Node(i), listen, rules.clone()).await?,
                                crate::proxy::udp(Party::Node(i), internal, rules.clone()).await?,
                                crate::proxy::tcp(
                                    Party::Node(i),
                                    Party::ControlPlane,
                                    cp_addr,
                                    rules,
                                )
                                .await?,
                            ))
                        })?;
                    net.client_fronts.push(client_front);
                    (
                        internal,
                        format!(
                            "client_advertise_addr: {client_front}\ninternal_advertise_addr: {internal_front}\n"
                        ),
                        format!("http://{cp_front}"),
                    )
                }
            };
            fronts.push_str(extra_yaml);
            let config = dir.path().join(format!("{node}.yaml"));
            std::fs::write(
                &config,
                format!(
                    "node_id: {node}\ncores: \"0-1\"\nfsync: on-commit\ntls_cert: {}\ntls_key: {}\npeer_ca: {}\ncontrolplane_url: {cp_url}\nnode_token: {node_token}\ninternal_listen: {internal}\n{fronts}",
                    certs.cert.display(),
                    certs.key.display(),
                    certs.ca.display(),
                ),
            )?;
            brokers.push(BrokerProcess::start_serve(
                broker,
                &dir.path().join(&node),
                &config,
                listen,
            )?);
        }
        Ok(TestCluster {
            dir,
            cp,
            admin,
            certs,
            brokers,
            client_token,
            net,
        })
    }

    /// Creates a stream.
    pub fn create_stream(
        &self,
        name: &str,
        shards: u32,
        replication_factor: u32,
        consistency: &str,
    ) -> anyhow::Result<()> {
        self.admin.post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams"),
            &json!({"stream": name, "kind": "Stream", "shards": shards,
                    "replication_factor": replication_factor, "consistency": consistency}),
        )?;
        Ok(())
    }

    /// Every shard assignment.
    pub fn assignments(&self) -> anyhow::Result<Vec<Value>> {
        Ok(self.admin.get("/v1/shard-assignments")?["items"]
            .as_array()
            .context("items")?
            .clone())
    }

    /// The assignment of `stream`'s `shard`.
    pub fn assignment(&self, stream: &str, shard: u32) -> Option<Value> {
        self.assignments().ok()?.into_iter().find(|a| {
            a["kind"] == "stream"
                && a["name"] == stream
                && a["shard"].as_u64() == Some(u64::from(shard))
        })
    }

    /// Leader of every shard, by `kind/name/shard`.
    pub fn leaders(&self) -> BTreeMap<String, String> {
        self.assignments()
            .unwrap_or_default()
            .iter()
            .map(|a| {
                (
                    format!(
                        "{}/{}/{}",
                        a["kind"].as_str().unwrap_or(""),
                        a["name"].as_str().unwrap_or(""),
                        a["shard"]
                    ),
                    a["leader"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    }

    /// The index of the broker named `node`.
    pub fn index(&self, node: &str) -> usize {
        node.strip_prefix("node-")
            .and_then(|n| n.parse().ok())
            .expect("node-<i>")
    }

    /// Waits until `stream`'s `shard` is led by a broker other than `not` (any when
    /// `None`) at a generation above `after`; returns (leader index, generation).
    pub fn wait_leader(
        &self,
        stream: &str,
        shard: u32,
        not: Option<usize>,
        after: u64,
        timeout: Duration,
    ) -> anyhow::Result<(usize, u64)> {
        wait_for("a leader", timeout, || {
            let a = self.assignment(stream, shard)?;
            let leader = self.index(a["leader"].as_str()?);
            let generation = a["generation"].as_u64()?;
            (not != Some(leader) && generation > after).then_some((leader, generation))
        })
    }

    /// A client configuration for the tenant, trusting the cluster's CA.
    pub fn client_config(&self) -> anyhow::Result<felix_client::ClientConfig> {
        let quinn = felix_client::quic_client_config_from_file(&self.certs.ca, false)?;
        let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None)?;
        config.auth_tenant_id = Some(TENANT.into());
        config.auth_token = Some(self.client_token.clone());
        Ok(config)
    }

    /// Every broker's client address (its proxy's, behind proxies).
    pub fn seeds(&self) -> Vec<SocketAddr> {
        match &self.net {
            Some(net) => net.client_fronts.clone(),
            None => self.brokers.iter().map(|b| b.listen).collect(),
        }
    }

    /// The link rules (behind proxies only).
    pub fn rules(&self) -> &Rules {
        &self.net.as_ref().expect("started with proxies").rules
    }

    /// The data directory.
    pub fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}
