//! A control plane and two brokers as processes: a 4-shard stream is placed across both,
//! the standard SDK publishes and reads through whichever broker leads each shard, and a
//! broker that stops heartbeating loses its shards after the expiry.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use felix_cluster::{
    BrokerProcess, ClusterCerts, ControlPlaneProcess, expect_success, free_udp_addr,
    run_python_args, wait_for,
};
use felix_controlplane::client::ControlPlaneClient;
use serde_json::{Value, json};

const BOOTSTRAP: &str = "cluster-test-bootstrap-token";

fn leaders(admin: &ControlPlaneClient) -> BTreeMap<String, String> {
    admin.get("/v1/shard-assignments").unwrap()["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                format!("{}/{}", a["kind"].as_str().unwrap(), a["shard"]),
                a["leader"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn token(admin: &ControlPlaneClient, tenant: &str, body: Value) -> String {
    admin
        .post(&format!("/v1/tenants/{tenant}/tokens"), &body)
        .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn broker_config(
    dir: &Path,
    certs: &ClusterCerts,
    url: &str,
    node: &str,
    node_token: &str,
) -> std::path::PathBuf {
    let path = dir.join(format!("{node}.yaml"));
    std::fs::write(
        &path,
        format!(
            "node_id: {node}\ncores: \"0\"\nfsync: none\ntls_cert: {}\ntls_key: {}\npeer_ca: {}\ncontrolplane_url: {url}\nnode_token: {node_token}\nmax_unfinished_frame_bytes_per_connection: 67108864\n",
            certs.cert.display(),
            certs.key.display(),
            certs.ca.display()
        ),
    )
    .unwrap();
    path
}

/// A control plane with fast timings (heartbeats every 200 ms, down after 1.5 s + a
/// margin), bootstrapped, with tenant `acme` and namespace `payments`: the process and
/// an admin client.
fn control_plane() -> anyhow::Result<(ControlPlaneProcess, ControlPlaneClient)> {
    let cp = ControlPlaneProcess::start(
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        &[
            "--bootstrap-token",
            BOOTSTRAP,
            "--heartbeat-interval-ms",
            "200",
            "--expiry-timeout-ms",
            "1500",
            "--placement-interval-ms",
            "200",
        ],
    )?;
    let anon = ControlPlaneClient::new(&cp.url, None)?;
    let boot = anon.post_with(
        "/internal/bootstrap",
        &json!({}),
        &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
    )?;
    let admin = anon.clone().with_token(boot["token"].as_str().unwrap());
    admin.post("/v1/tenants", &json!({"tenant_id": "acme"}))?;
    admin.post(
        "/v1/tenants/acme/namespaces",
        &json!({"namespace": "payments"}),
    )?;
    Ok((cp, admin))
}

#[test]
fn two_brokers_follow_the_control_plane() -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("felix-cluster")
        .tempdir_in("/var/tmp")?;
    let (cp, admin) = control_plane()?;
    admin.post(
        "/v1/tenants/acme/namespaces/payments/streams",
        &json!({"stream": "orders", "kind": "Stream", "shards": 4}),
    )?;
    admin.post(
        "/v1/tenants/acme/namespaces/payments/caches",
        &json!({"cache": "sessions", "shards": 2}),
    )?;
    let client_token = dir.path().join("client.token");
    std::fs::write(
        &client_token,
        token(
            &admin,
            "acme",
            json!({"sub": "app", "audience": "felix-broker", "perms": felix_wire::token::all_data_perms("acme")}),
        ),
    )?;

    let certs = ClusterCerts::write(dir.path())?;
    let binary = Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    let mut brokers = Vec::new();
    for node in ["node-a", "node-b"] {
        let node_token = token(
            &admin,
            "operator",
            json!({"sub": node, "audience": "felix-controlplane", "perms": [format!("node.manage:node:{node}"), "node.view:cluster:*"]}),
        );
        let config = broker_config(dir.path(), &certs, &cp.url, node, &node_token);
        let data = dir.path().join(node);
        brokers.push(BrokerProcess::start_serve(
            binary,
            &data,
            &config,
            free_udp_addr()?,
        )?);
    }

    // Placement spreads the 4 stream shards (and 2 cache shards) across both brokers.
    let placed = wait_for(
        "6 shards placed on both brokers",
        Duration::from_secs(20),
        || {
            let l = leaders(&admin);
            let on_a = l.values().filter(|n| *n == "node-a").count();
            (l.len() == 6 && on_a == 3).then_some(l)
        },
    )?;
    let streams_on: Vec<usize> = ["node-a", "node-b"]
        .iter()
        .map(|n| {
            placed
                .iter()
                .filter(|(k, v)| k.starts_with("stream") && *v == n)
                .count()
        })
        .collect();
    assert!(
        streams_on.iter().all(|n| *n >= 1),
        "stream shards on both brokers: {placed:?}"
    );
    // Each broker learns its share.
    wait_for("brokers see their routes", Duration::from_secs(10), || {
        let led: Vec<u64> = brokers
            .iter()
            .map(|b| b.metric("felix_broker_shards_led").unwrap_or(0))
            .collect();
        (led == [3, 3]).then_some(())
    })?;

    // The standard SDK, seeded with both brokers.
    let seeds = format!("{},{}", brokers[0].listen, brokers[1].listen);
    let (token_path, ca) = (
        client_token.display().to_string(),
        certs.ca.display().to_string(),
    );
    let out = run_python_args(
        "cluster.py",
        &[&seeds, &token_path, &ca, "first", "sessions"],
    )?;
    println!("{}", expect_success("cluster.py (both brokers)", &out)?);
    for b in &brokers {
        assert!(
            b.metric("felix_broker_publish_records_total")? > 0,
            "every broker stored records for the shards it leads"
        );
    }
    // The standard SDK went straight to each leader. A client that knows only node-a
    // still reaches every shard: node-a forwards, and a subscribe to a shard node-b
    // leads is answered with not_leader naming node-b.
    let rt = tokio::runtime::Runtime::new()?;
    let quinn = felix_client::quic_client_config_from_file(&certs.ca, false)?;
    let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None)?;
    config.auth_tenant_id = Some("acme".into());
    config.auth_token = Some(std::fs::read_to_string(&client_token)?);
    let b_stream_shard: u32 = placed
        .iter()
        .find(|(k, v)| k.starts_with("stream") && *v == "node-b")
        .map(|(k, _)| k.rsplit('/').next().unwrap().parse().unwrap())
        .unwrap();
    let before = brokers[0].metric("felix_broker_forwarded_total")?;
    rt.block_on(async {
        let c =
            felix_client::Client::connect(brokers[0].listen, "localhost", config.clone()).await?;
        for i in 0..40 {
            let key = bytes::Bytes::from(format!("direct-{i}"));
            let off = c
                .publish_keyed(
                    "acme",
                    "payments",
                    "orders",
                    key,
                    b"x".to_vec(),
                    felix_client::AckMode::PerMessage,
                )
                .await?;
            assert!(
                off.is_some(),
                "a forwarded publish is acked with its offset"
            );
        }
        for i in 0..20 {
            let k = format!("d{i}");
            c.cache_put(
                "acme",
                "payments",
                "sessions",
                &k,
                bytes::Bytes::from_static(b"v"),
                None,
            )
            .await?;
            let got = c.cache_get("acme", "payments", "sessions", &k).await?;
            assert_eq!(got.as_deref(), Some(&b"v"[..]));
            // Forwarded too, a get answers the value's version (the leader is asked
            // for it with the client's features).
            let versioned = c
                .cache_get_versioned("acme", "payments", "sessions", &k)
                .await?;
            assert!(
                matches!(&versioned, Some((v, _)) if v.as_ref() == b"v"),
                "{k}: {versioned:?}"
            );
        }
        // An idempotent batch forwarded to its leader: a re-send is answered from the
        // log, another batch under its sequence is refused typed, `sequence_reused`
        // (this client reads it), as at the leader itself. The forwarder did not ask
        // the leader for that reason before 2026-12-05: the client got `invalid_request`,
        // which our producer takes as an outcome in doubt and sends again, for good.
        let producer = c.producer_init().await?;
        let idempotent = |body: &'static str| {
            let c = c.clone();
            async move {
                c.publish_idempotent(
                    "acme",
                    "payments",
                    "orders",
                    Some(b_stream_shard),
                    vec![bytes::Bytes::from_static(body.as_bytes())],
                    producer,
                    0,
                )
                .await
            }
        };
        let first = idempotent("i-0").await?;
        assert_eq!(idempotent("i-0").await?, first, "a forwarded re-send");
        match idempotent("i-1").await {
            Err(felix_client::ClientError::Refused {
                reason: felix_wire::message::PublishRefusalReason::SequenceReused,
                ..
            }) => {}
            other => panic!("a forwarded batch under a used sequence: {other:?}"),
        }
        match c
            .subscribe_shard("acme", "payments", "orders", b_stream_shard, None)
            .await
        {
            Err(felix_client::ClientError::NotLeader(nl)) => {
                assert_eq!(nl.node_id, "node-b");
                assert_eq!(nl.addr, Some(brokers[1].listen.to_string()));
            }
            other => panic!(
                "expected not_leader for shard {b_stream_shard}, got {:?}",
                other.err()
            ),
        }
        // Our ClusterClient, seeded with node-a alone, follows the redirect and reads
        // the records node-b holds.
        let quinn = felix_client::quic_client_config_from_file(&certs.ca, false)?;
        let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None)?;
        config.auth_tenant_id = Some("acme".into());
        config.auth_token = Some(std::fs::read_to_string(&client_token)?);
        let cc =
            felix_client::ClusterClient::connect(&[brokers[0].listen], "localhost", config.clone())
                .await?;
        let mut sub = cc
            .subscribe_shard(
                "acme",
                "payments",
                "orders",
                b_stream_shard,
                Some(felix_client::StartPosition::Earliest),
            )
            .await?;
        let first = tokio::time::timeout(Duration::from_secs(10), sub.next_event()).await??;
        assert!(
            first.is_some(),
            "the redirected subscription delivers node-b's records"
        );
        // Large publishes forwarded at once by several clients' connections: node-a
        // sends them to node-b over one connection, and node-b closes a connection whose
        // unfinished frames pass 64 MiB (here). node-a's forwarder has at most 32 MiB of
        // requests unanswered at its peers, so none is refused (48 x 4 MiB).
        let keys: Vec<bytes::Bytes> = (0..)
            .map(|i| format!("big-{i}"))
            .filter(|k| {
                felix_wire::shard_for_key(Some(k.as_bytes()), 4, Default::default()).0
                    == b_stream_shard
            })
            .take(48)
            .map(bytes::Bytes::from)
            .collect();
        let forwarded_before = brokers[0].metric("felix_broker_forwarded_total")?;
        let mut tasks = Vec::new();
        for keys in keys.chunks(12) {
            let c = felix_client::Client::connect(brokers[0].listen, "localhost", config.clone())
                .await?;
            for key in keys {
                let (c, key) = (c.clone(), key.clone());
                tasks.push(tokio::spawn(async move {
                    c.publish_keyed(
                        "acme",
                        "payments",
                        "orders",
                        key,
                        vec![4u8; 4 << 20],
                        felix_client::AckMode::PerMessage,
                    )
                    .await
                }));
            }
        }
        for t in tasks {
            let acked = t.await?;
            assert!(
                matches!(acked, Ok(Some(_))),
                "a large forwarded publish is acked: {acked:?}"
            );
        }
        assert_eq!(
            brokers[0].metric("felix_broker_forwarded_total")? - forwarded_before,
            48,
            "node-a forwarded them all to node-b"
        );
        assert_eq!(
            brokers[1].metric("felix_broker_unfinished_frames_closed_total")?,
            0
        );
        anyhow::Ok(())
    })?;
    let forwarded = brokers[0].metric("felix_broker_forwarded_total")? - before;
    assert!(
        forwarded >= 20,
        "node-a forwarded node-b's publishes and cache ops ({forwarded})"
    );

    // node-b stops heartbeating (frozen). It is declared down, but its shards have one
    // durable copy, on node-b: they wait for it rather than reopen empty on node-a.
    brokers[1].signal(libc::SIGSTOP);
    let key = (0..)
        .map(|i| format!("probe-{i}"))
        .find(|k| {
            felix_wire::routing::shard_for_key(
                Some(k.as_bytes()),
                4,
                felix_wire::routing::ShardRouting::Modulo,
            )
            .0 == b_stream_shard
        })
        .expect("some key lands on that shard");
    let client_config = || -> anyhow::Result<felix_client::ClientConfig> {
        let quinn = felix_client::quic_client_config_from_file(&certs.ca, false)?;
        let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None)?;
        config.auth_tenant_id = Some("acme".into());
        config.auth_token = Some(std::fs::read_to_string(&client_token)?);
        Ok(config)
    };
    // Before node-b is declared down, node-a still forwards to it over the connection
    // it already holds, which looks alive: the frozen leader never closes it. The
    // forwarded publish is answered (outcome unknown) once that connection has been
    // silent for its idle timeout, not after the 30 s answer timeout.
    let started = std::time::Instant::now();
    let answered = rt.block_on(async {
        let c =
            felix_client::Client::connect(brokers[0].listen, "localhost", client_config()?).await?;
        let publish = c.publish_keyed(
            "acme",
            "payments",
            "orders",
            bytes::Bytes::from(key.clone()),
            b"x".to_vec(),
            felix_client::AckMode::PerMessage,
        );
        anyhow::Ok(tokio::time::timeout(Duration::from_secs(15), publish).await)
    })?;
    let waited = started.elapsed();
    eprintln!("publish forwarded to the frozen leader answered after {waited:?}: {answered:?}");
    assert!(
        matches!(answered, Ok(Err(_))),
        "a publish forwarded to a frozen leader is refused, not acked or left hanging: {answered:?}"
    );
    assert!(
        waited < Duration::from_secs(8),
        "a publish forwarded to a frozen leader waited {waited:?}"
    );
    let frozen = wait_for("node-b declared down", Duration::from_secs(15), || {
        (admin.get("/v1/nodes/node-b").ok()?["lifecycle"] == "down").then_some(())
    });
    let held = frozen.and_then(|()| {
        // A few placement passes later the shards are still node-b's.
        std::thread::sleep(Duration::from_millis(800));
        let l = leaders(&admin);
        anyhow::ensure!(
            l.values().filter(|n| *n == "node-b").count() == 3,
            "node-b's shards stayed with their only copy: {l:?}"
        );
        // Through node-a, a publish to one of them is refused (typed, retryable),
        // never stored in an empty log.
        rt.block_on(async {
            let config = client_config()?;
            // node-a learns node-b is down at its next sync (within a couple of seconds);
            // until then it forwards, and the frozen node-b does not answer (a fresh
            // connection per attempt: answers on one stream come in request order).
            let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
            loop {
                let c =
                    felix_client::Client::connect(brokers[0].listen, "localhost", config.clone())
                        .await?;
                let attempt = tokio::time::timeout(
                    Duration::from_secs(2),
                    c.publish_keyed(
                        "acme",
                        "payments",
                        "orders",
                        bytes::Bytes::from(key.clone()),
                        b"x".to_vec(),
                        felix_client::AckMode::PerMessage,
                    ),
                )
                .await;
                match attempt {
                    Ok(Err(felix_client::ClientError::Broker(e)))
                        if e.code == Some(felix_wire::ErrorCode::ShardUnavailable) =>
                    {
                        break;
                    }
                    Ok(Ok(o)) => {
                        anyhow::bail!("a write to the frozen owner's shard was acked at {o:?}")
                    }
                    _ if tokio::time::Instant::now() < deadline => continue,
                    other => anyhow::bail!("expected shard_unavailable, got {other:?}"),
                }
            }
            anyhow::Ok(())
        })
    });
    brokers[1].signal(libc::SIGCONT);
    held?;
    // node-b, thawed, registers again as a new incarnation and serves its shards with
    // every record they held.
    wait_for("node-b live again", Duration::from_secs(10), || {
        let n = admin.get("/v1/nodes/node-b").ok()?;
        (n["lifecycle"] == "live" && n["incarnation"].as_u64()? >= 2).then_some(())
    })?;
    // node-a routes to node-b again once it has synced: a write to node-b's shard
    // through node-a is acked.
    let b_key = key.clone();
    wait_for(
        "node-a routes to node-b again",
        Duration::from_secs(15),
        || {
            rt.block_on(async {
                let quinn = felix_client::quic_client_config_from_file(&certs.ca, false).ok()?;
                let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None).ok()?;
                config.auth_tenant_id = Some("acme".into());
                config.auth_token = std::fs::read_to_string(&client_token).ok();
                let c = felix_client::Client::connect(brokers[0].listen, "localhost", config)
                    .await
                    .ok()?;
                let probe = c.stream_shards("acme", "payments", "orders");
                let _ = tokio::time::timeout(Duration::from_secs(2), probe)
                    .await
                    .ok()?;
                let publish = c.publish_keyed(
                    "acme",
                    "payments",
                    "orders",
                    bytes::Bytes::from(b_key.clone()),
                    b"probe".to_vec(),
                    felix_client::AckMode::PerMessage,
                );
                tokio::time::timeout(Duration::from_secs(2), publish)
                    .await
                    .ok()?
                    .ok()
                    .flatten()
            })
        },
    )?;
    let only_a = brokers[0].listen.to_string();
    let out = run_python_args("cluster.py", &[&only_a, &token_path, &ca, "after-thaw"])?;
    expect_success("cluster.py (after node-b came back)", &out)?;
    let expected = (0..120)
        .filter(|i| {
            felix_wire::routing::shard_for_key(
                Some(format!("key-{i}").as_bytes()),
                4,
                felix_wire::routing::ShardRouting::Modulo,
            )
            .0 == b_stream_shard
        })
        .count();
    rt.block_on(async {
        let quinn = felix_client::quic_client_config_from_file(&certs.ca, false)?;
        let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None)?;
        config.auth_tenant_id = Some("acme".into());
        config.auth_token = Some(std::fs::read_to_string(&client_token)?);
        let cc =
            felix_client::ClusterClient::connect(&[brokers[0].listen], "localhost", config).await?;
        let mut sub = cc
            .subscribe_shard(
                "acme",
                "payments",
                "orders",
                b_stream_shard,
                Some(felix_client::StartPosition::Earliest),
            )
            .await?;
        let mut first_run = 0;
        while let Ok(Ok(Some(e))) =
            tokio::time::timeout(Duration::from_secs(3), sub.next_event()).await
        {
            if e.payload.starts_with(b"first-") {
                first_run += 1;
            }
        }
        anyhow::ensure!(
            first_run == expected,
            "node-b's shard still holds the first run's {expected} records (got {first_run})"
        );
        anyhow::Ok(())
    })?;
    Ok(())
}

#[test]
fn felix_stream_create_and_list_go_through_the_control_plane() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cp = ControlPlaneProcess::start(
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        &["--bootstrap-token", BOOTSTRAP],
    )?;
    let anon = ControlPlaneClient::new(&cp.url, None)?;
    let boot = anon.post_with(
        "/internal/bootstrap",
        &json!({}),
        &[("X-Felix-Bootstrap-Token", BOOTSTRAP)],
    )?;
    let admin = anon.clone().with_token(boot["token"].as_str().unwrap());
    admin.post("/v1/tenants", &json!({"tenant_id": "acme"}))?;
    admin.post(
        "/v1/tenants/acme/namespaces",
        &json!({"namespace": "payments"}),
    )?;
    let token_file = dir.path().join("acme-admin.token");
    std::fs::write(
        &token_file,
        token(
            &admin,
            "acme",
            json!({"sub": "ops", "audience": "felix-controlplane", "perms": ["tenant.manage:tenant:acme"]}),
        ),
    )?;
    let felix = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_felix-under-test"))
            .args([
                "--controlplane",
                &cp.url,
                "--tenant",
                "acme",
                "--namespace",
                "payments",
            ])
            .arg("--controlplane-token-file")
            .arg(&token_file)
            .args(args)
            .output()
            .unwrap()
    };
    let out = felix(&[
        "stream",
        "create",
        "audit",
        "--shards",
        "3",
        "--routing",
        "jump-hash",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "created acme/payments/audit with 3 shards"
    );
    let again = felix(&["stream", "create", "audit", "--shards", "3"]);
    assert_eq!(again.status.code(), Some(6), "a duplicate is a conflict");
    assert!(String::from_utf8_lossy(&again.stderr).contains("409"));
    let zero = felix(&["stream", "create", "empty", "--shards", "0"]);
    assert_eq!(
        zero.status.code(),
        Some(2),
        "invalid input is a usage error"
    );
    assert!(String::from_utf8_lossy(&zero.stderr).contains("shards"));
    let list = felix(&["stream", "list", "--json"]);
    assert_eq!(list.status.code(), Some(0));
    let streams: Vec<Value> = String::from_utf8_lossy(&list.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(streams.len(), 1);
    assert_eq!(
        (
            streams[0]["stream"].as_str(),
            streams[0]["shards"].as_u64(),
            streams[0]["routing"].as_str()
        ),
        (Some("audit"), Some(3), Some("jump_hash"))
    );
    // Another tenant's namespace is forbidden; no control plane is a usage error.
    let other = std::process::Command::new(env!("CARGO_BIN_EXE_felix-under-test"))
        .args([
            "--controlplane",
            &cp.url,
            "--tenant",
            "globex",
            "stream",
            "list",
            "--controlplane-token-file",
        ])
        .arg(&token_file)
        .output()?;
    assert_eq!(other.status.code(), Some(4));
    let nowhere = std::process::Command::new(env!("CARGO_BIN_EXE_felix-under-test"))
        .args(["stream", "list"])
        .env_remove("FELIX_CONTROLPLANE_URL")
        .output()?;
    assert_eq!(nowhere.status.code(), Some(2));
    Ok(())
}

/// Two brokers started under one node id would both believe they lead that node's
/// shards. The control plane refuses the second while the first heartbeats (it is a
/// different process: another data directory, so another instance id), the second
/// exits with the reason, and the first keeps its registration and its shards. Once the
/// first is gone and silent past the down timeout, the id is free (a replaced disk).
#[test]
fn a_second_broker_under_a_live_node_id_is_refused_and_the_first_keeps_its_shards()
-> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("felix-cluster")
        .tempdir_in("/var/tmp")?;
    let (cp, admin) = control_plane()?;
    admin.post(
        "/v1/tenants/acme/namespaces/payments/streams",
        &json!({"stream": "orders", "kind": "Stream", "shards": 2}),
    )?;
    let certs = ClusterCerts::write(dir.path())?;
    let binary = Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    let node_token = token(
        &admin,
        "operator",
        json!({"sub": "node-a", "audience": "felix-controlplane", "perms": ["node.manage:node:node-a", "node.view:cluster:*"]}),
    );
    let config = broker_config(dir.path(), &certs, &cp.url, "node-a", &node_token);
    let mut first =
        BrokerProcess::start_serve(binary, &dir.path().join("first"), &config, free_udp_addr()?)?;
    wait_for("2 shards on node-a", Duration::from_secs(20), || {
        let l = leaders(&admin);
        (l.len() == 2 && l.values().all(|n| n == "node-a")).then_some(())
    })?;
    let before = admin.get("/v1/nodes/node-a")?;
    assert!(
        before["instance_id"]
            .as_str()
            .is_some_and(|i| i.len() == 32),
        "{before}"
    );

    // The impostor: same config and node id, its own data directory and port.
    let second_dir = dir.path().join("second");
    let second_listen = free_udp_addr()?;
    let serve = |data: &Path| {
        std::process::Command::new(binary)
            .args(["serve", "--config"])
            .arg(&config)
            .arg("--data-dir")
            .arg(data)
            .args([
                "--listen",
                &second_listen.to_string(),
                "--http",
                "127.0.0.1:0",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
    };
    let mut impostor = serve(&second_dir)?;
    let status = wait_for("the impostor exits", Duration::from_secs(20), || {
        impostor.try_wait().ok().flatten()
    });
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            let _ = impostor.kill();
            let _ = impostor.wait();
            return Err(e.context("a second broker under node-a kept running"));
        }
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut impostor.stderr.take().unwrap(), &mut stderr)?;
    assert!(!status.success(), "refused, so a failed start: {status}");
    assert!(
        stderr.contains("node_id_in_use") || stderr.contains("held by another broker"),
        "the reason is given: {stderr}"
    );

    // Longer than the expiry: the first kept its registration, heartbeats and shards.
    std::thread::sleep(Duration::from_secs(2));
    let after = admin.get("/v1/nodes/node-a")?;
    assert_eq!(
        (
            &after["instance_id"],
            &after["incarnation"],
            &after["lifecycle"],
            &after["client_addr"]
        ),
        (
            &before["instance_id"],
            &before["incarnation"],
            &json!("live"),
            &before["client_addr"]
        ),
        "the first broker's registration is untouched"
    );
    assert!(leaders(&admin).values().all(|n| n == "node-a"));
    assert!(first.exit_status().is_none(), "the first broker still runs");

    // The first gone and silent past the down timeout: the id is free again.
    first.kill();
    std::thread::sleep(Duration::from_millis(2500));
    let replacement = BrokerProcess::start_serve(binary, &second_dir, &config, second_listen)?;
    let now = wait_for(
        "the replacement registered",
        Duration::from_secs(20),
        || {
            admin
                .get("/v1/nodes/node-a")
                .ok()
                .filter(|n| n["instance_id"] != before["instance_id"] && n["lifecycle"] == "live")
        },
    )?;
    assert_eq!(now["client_addr"], json!(second_listen.to_string()));
    drop(replacement);
    Ok(())
}

/// A clustered broker answers on its port before its first sync with the control plane
/// has brought the tenants' keys. A client that authenticates then must be told to
/// retry (`shard_unavailable` / `not_ready`), never `unauthenticated`, which is fatal to
/// a client: after every restart some clients would give up. Found by the chaos scenario
/// `filesystem-full-replicated` (publishes refused "unknown tenant" after a restart).
#[test]
fn a_broker_still_joining_tells_clients_to_retry_rather_than_refusing_their_token()
-> anyhow::Result<()> {
    use felix_cluster::cluster::{CP_ARGS, TENANT, TestCluster};
    use felix_cluster::proxy::{Link, Party};
    use felix_wire::{ErrorCode, Message};

    let mut c = TestCluster::start_with_proxies(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        1,
        CP_ARGS,
        "",
    )?;
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let (addr, ca) = (c.brokers[0].listen, c.certs.ca.clone());
    let auth = felix_cluster::raw_auth(TENANT, &c.client_token);
    // One authentication on a fresh connection: the broker's answer, or `None` while
    // nothing answers on the port.
    let rt = tokio::runtime::Runtime::new()?;
    let answer = || -> Option<Message> {
        rt.block_on(async {
            let (_ep, conn) = tokio::time::timeout(
                Duration::from_millis(500),
                felix_cluster::raw_connect_to(addr, &ca),
            )
            .await
            .ok()?
            .ok()?;
            let (mut send, mut recv) = conn.open_bi().await.ok()?;
            send.write_all(&auth).await.ok()?;
            let got = tokio::time::timeout(
                Duration::from_secs(2),
                felix_cluster::read_messages(&mut recv, 1),
            )
            .await
            .ok()?
            .ok()?;
            got.into_iter().next().flatten()
        })
    };
    assert!(
        matches!(answer(), Some(Message::AuthOk { .. })),
        "a joined broker authenticates the client"
    );
    // Restarted cut off from the control plane: it serves its port and keeps trying
    // to join.
    rules.set(Party::Node(0), Party::ControlPlane, Link::cut());
    std::thread::scope(|s| -> anyhow::Result<()> {
        let broker = &mut c.brokers[0];
        let restarting = s.spawn(move || broker.restart());
        let refusal = wait_for(
            "the restarted broker to answer",
            Duration::from_secs(20),
            &answer,
        );
        rules.heal();
        restarting.join().expect("restart thread")?;
        match refusal? {
            Message::Error {
                code: Some(ErrorCode::ShardUnavailable),
                ..
            } => Ok(()),
            other => anyhow::bail!("a broker not yet joined answered {other:?}"),
        }
    })?;
    assert!(
        matches!(answer(), Some(Message::AuthOk { .. })),
        "joined again, it authenticates the client"
    );
    Ok(())
}

/// A broker forwarding requests for a shard another broker leads keeps one connection to
/// the leader per token identity: when one token is denied, the leader closes the
/// connection its forwarded streams were authenticated on, and another token of the same
/// tenant, forwarding through the same broker meanwhile, loses nothing in flight. (With
/// one connection per tenant, the denial failed the other token's forwarded requests.)
#[test]
fn a_denied_token_fails_no_request_another_token_has_forwarded() -> anyhow::Result<()> {
    use felix_cluster::cluster::{CP_ARGS, NAMESPACE, TENANT, TestCluster};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let c = TestCluster::start(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        2,
        CP_ARGS,
        "",
    )?;
    c.create_stream("orders", 1, 1, "Quorum")?;
    let (leader, _) = c.wait_leader("orders", 0, None, 0, Duration::from_secs(20))?;
    let via = c.brokers[1 - leader].listen;
    let issue = |sub: &str| -> anyhow::Result<Value> {
        Ok(c.admin.post(
            &format!("/v1/tenants/{TENANT}/tokens"),
            &json!({"sub": sub, "audience": "felix-broker", "perms": felix_wire::token::all_data_perms(TENANT)}),
        )?)
    };
    let (denied, kept) = (issue("denied")?, issue("kept")?);
    assert_ne!(denied["jti"], kept["jti"]);
    let connect = |token: &Value| {
        let mut config = c.client_config()?;
        config.auth_token = Some(token["token"].as_str().unwrap_or_default().to_owned());
        anyhow::Ok(felix_client::Client::connect(via, "localhost", config))
    };
    let publish = |client: Arc<felix_client::Client>| async move {
        client
            .publish(
                TENANT,
                NAMESPACE,
                "orders",
                b"x".to_vec(),
                felix_client::AckMode::PerMessage,
            )
            .await
    };
    let revoked = || c.brokers[leader].metric("felix_broker_revoked_connections_total");
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        // The forwarding broker learns the keys and the route with its syncs.
        let started = std::time::Instant::now();
        let denied_client = loop {
            if let Ok(client) = connect(&denied)?.await {
                let client = Arc::new(client);
                if publish(client.clone()).await.is_ok() {
                    break client;
                }
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(20),
                "no publish was forwarded"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Each core of the forwarding broker has a forwarder of its own, and a client's
        // connection lands on either core: connect until each token has a client on
        // every core (read off the broker's per-core connection gauge), so that both
        // tokens' requests go through each core's forwarder.
        let forwarding = &c.brokers[1 - leader];
        let per_core = || -> Vec<u64> {
            let (_, body) = forwarding.http_get("/metrics").unwrap_or_default();
            (0..2)
                .map(|core| {
                    let prefix = format!("felix_broker_connections{{core=\"{core}\"}} ");
                    body.lines()
                        .find_map(|l| l.strip_prefix(prefix.as_str())?.trim().parse().ok())
                        .unwrap_or(0)
                })
                .collect()
        };
        let mut clients: [Vec<Arc<felix_client::Client>>; 2] = [vec![denied_client], Vec::new()];
        for (i, token) in [&denied, &kept].into_iter().enumerate() {
            let mut cores = [false; 2];
            for _ in 0..32 {
                if cores == [true, true] {
                    break;
                }
                let before = per_core();
                let client = Arc::new(connect(token)?.await?);
                publish(client.clone()).await?;
                let after = per_core();
                if let Some(core) = (0..2).find(|&c| after[c] > before[c]) {
                    cores[core] = true;
                }
                clients[i].push(client);
            }
            anyhow::ensure!(
                cores == [true, true],
                "token {i}'s connections did not reach both cores: {cores:?}"
            );
        }
        let [denied_clients, kept_clients] = clients;

        // The kept token's load: eight publishes in flight through the forwarder.
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicU64::new(0));
        let mut load = Vec::new();
        for i in 0..8 {
            let client = kept_clients[i % kept_clients.len()].clone();
            let (stop, acked) = (stop.clone(), acked.clone());
            load.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    publish(client.clone()).await?;
                    acked.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(())
            }));
        }
        let before = revoked()?;
        c.admin.post(
            &format!("/v1/tenants/{TENANT}/token-denials"),
            &json!({"jti": denied["jti"], "reason": "test"}),
        )?;
        let started = std::time::Instant::now();
        while revoked()? == before {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(10),
                "the leader never closed the denied token's forwarding connection"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let at_close = acked.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        for task in load {
            task.await?
                .map_err(|e| e.context("a publish of the kept token failed"))?;
        }
        assert!(
            acked.load(Ordering::Relaxed) > at_close,
            "the kept token went on publishing after the denial"
        );
        assert!(
            publish(denied_clients[0].clone()).await.is_err(),
            "the denied token publishes no more"
        );
        anyhow::Ok(())
    })
}
