//! Replicated shards across three brokers and a control plane, driven by our SDK: a
//! Quorum leader killed under load loses nothing it acknowledged; a leader paused past
//! its lease acknowledges nothing after it wakes; a Leader stream loses at most the lag
//! it reported.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use felix_cluster::cluster::{CP_ARGS, NAMESPACE, TENANT, TestCluster};
use felix_cluster::wait_for;
use felix_wire::AckMode;
use felix_wire::message::StartPosition;
use serde_json as _;

fn cluster() -> TestCluster {
    cluster_with("")
}

/// Three brokers behind proxies (`c.net` sets each link between them).
fn proxied_cluster() -> TestCluster {
    TestCluster::start_with_proxies(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        3,
        CP_ARGS,
        "",
    )
    .unwrap()
}

/// One broker behind proxies, its lease 3 s (held 2.25 s; the node declared down only
/// after 3.75 s): a cut from the control plane lapses the lease well before the
/// control plane gives up on the node.
fn one_broker_with_a_short_lease() -> TestCluster {
    TestCluster::start_with_proxies(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        1,
        &[
            "--heartbeat-interval-ms",
            "200",
            "--expiry-timeout-ms",
            "3000",
            "--placement-interval-ms",
            "200",
        ],
        "",
    )
    .unwrap()
}

/// Three brokers with `yaml` appended to each one's config.
fn cluster_with(yaml: &str) -> TestCluster {
    TestCluster::start(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        3,
        CP_ARGS,
        yaml,
    )
    .unwrap()
}

/// Arms (or, with `clear=true`, clears) broker `b`'s storage fault seam (a cluster
/// started with `fault_injection: true`).
fn storage_fault(c: &TestCluster, b: usize, query: &str) {
    let (status, body) = c.brokers[b]
        .http_post(&format!("/debug/storage-faults?{query}"))
        .unwrap();
    assert_eq!(status, 200, "{body}");
}

/// The broker leading the first shard of `kind` (named `name`, or any) and its
/// generation, once the control plane assigned one.
fn leader_and_generation(c: &TestCluster, kind: &str, name: Option<&str>) -> Option<(usize, u64)> {
    c.assignments()
        .ok()?
        .into_iter()
        .find(|a| a["kind"] == kind && name.is_none_or(|n| a["name"] == n))
        .map(|a| {
            (
                c.index(a["leader"].as_str().unwrap()),
                a["generation"].as_u64().unwrap(),
            )
        })
}

/// Records acknowledged so far: offset -> payload.
type Acked = Arc<Mutex<BTreeMap<u64, Vec<u8>>>>;

/// Publishes one record at a time through a ClusterClient seeded with every broker
/// until `stop`, recording each acknowledgement.
async fn publish_until(
    c: &TestCluster,
    stream: &str,
    tag: &str,
    acked: Acked,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> usize {
    let connect = || async {
        felix_client::ClusterClient::connect(&c.seeds(), "localhost", c.client_config().unwrap())
            .await
    };
    let mut client = connect().await.unwrap();
    let (mut i, mut failed) = (0usize, 0usize);
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let payload = format!("{tag}-{i}").into_bytes();
        i += 1;
        let sent = tokio::time::timeout(
            Duration::from_secs(2),
            client.publish(
                TENANT,
                NAMESPACE,
                stream,
                payload.clone(),
                AckMode::PerMessage,
            ),
        )
        .await;
        match sent {
            Ok(Ok(Some(offset))) => {
                let old = acked.lock().unwrap().insert(offset, payload);
                assert!(old.is_none(), "offset {offset} acknowledged twice");
            }
            Ok(_) => failed += 1,
            Err(_) => {
                // A connection to a dead broker hangs until its idle timeout: start over.
                failed += 1;
                if let Ok(c) = connect().await {
                    client = c;
                }
            }
        }
    }
    failed
}

/// Every record of shard 0, read from its leader: offset -> payload. Subscribes again
/// until the leader serves and the read reaches `at_least` (or 30 s pass).
async fn read_all(c: &TestCluster, stream: &str, at_least: u64) -> BTreeMap<u64, Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = BTreeMap::new();
    while Instant::now() < deadline {
        got.clear();
        let Ok(client) = felix_client::ClusterClient::connect(
            &c.seeds(),
            "localhost",
            c.client_config().unwrap(),
        )
        .await
        else {
            continue;
        };
        let Ok(mut sub) = client
            .subscribe_shard(TENANT, NAMESPACE, stream, 0, Some(StartPosition::Earliest))
            .await
        else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        while let Ok(Ok(Some(e))) =
            tokio::time::timeout(Duration::from_secs(2), sub.next_event()).await
        {
            let o = e.offset.expect("durable streams carry offsets");
            assert!(
                got.insert(o, e.payload.to_vec()).is_none(),
                "offset {o} delivered twice"
            );
        }
        if got.keys().next_back().is_some_and(|o| *o + 1 >= at_least) {
            break;
        }
    }
    got
}

/// Every acknowledged publish of [`publish_one_at_a_time`]: (sent, acknowledged, offset,
/// payload).
type Published = Arc<Mutex<Vec<(Instant, Instant, u64, Vec<u8>)>>>;

/// Publishes small labelled records (`m-<i>`) one at a time to `stream` through a
/// ClusterClient until `stop` (2 s bound each, no retry), recording every
/// acknowledgement in `log`; answers the failures by message. Blocks: run it on a
/// thread of its own. Takes the seeds and configuration rather than the cluster, so a
/// test may kill brokers meanwhile.
fn publish_one_at_a_time(
    (seeds, config): (Vec<std::net::SocketAddr>, felix_client::ClientConfig),
    stream: &str,
    log: Published,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> BTreeMap<String, u64> {
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(async move {
            let client = felix_client::ClusterClient::connect(&seeds, "localhost", config)
                .await
                .unwrap();
            let (mut i, mut failed) = (0u64, BTreeMap::<String, u64>::new());
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let payload = format!("m-{i}").into_bytes();
                i += 1;
                let sent = Instant::now();
                let publish = client.publish(
                    TENANT,
                    NAMESPACE,
                    stream,
                    payload.clone(),
                    AckMode::PerMessage,
                );
                match tokio::time::timeout(Duration::from_secs(2), publish).await {
                    Ok(Ok(Some(o))) => log.lock().unwrap().push((sent, Instant::now(), o, payload)),
                    Ok(Ok(None)) => *failed.entry("no offset".into()).or_default() += 1,
                    Ok(Err(e)) => *failed.entry(e.to_string()).or_default() += 1,
                    Err(_) => *failed.entry("timed out (2 s)".into()).or_default() += 1,
                }
            }
            failed
        })
}

/// The seeds and client configuration of `c`, for [`publish_one_at_a_time`].
fn client_of(c: &TestCluster) -> (Vec<std::net::SocketAddr>, felix_client::ClientConfig) {
    (c.seeds(), c.client_config().unwrap())
}

/// Checks the stream's log against what [`publish_one_at_a_time`] had acknowledged:
/// no offset acknowledged twice, every acknowledged record at its offset, no record in
/// the log twice. Answers (acknowledged, read back) by offset.
fn check_published(
    c: &TestCluster,
    stream: &str,
    log: &[(Instant, Instant, u64, Vec<u8>)],
) -> (BTreeMap<u64, Vec<u8>>, BTreeMap<u64, Vec<u8>>) {
    let acked: BTreeMap<u64, Vec<u8>> = log.iter().map(|(_, _, o, p)| (*o, p.clone())).collect();
    assert_eq!(acked.len(), log.len(), "no offset acknowledged twice");
    let read = check_read_back(c, stream, &acked, "record");
    (acked, read)
}

/// Reads `stream`'s log back and checks every acknowledged `what` is at its offset and
/// none is there twice; answers the log by offset.
fn check_read_back(
    c: &TestCluster,
    stream: &str,
    acked: &BTreeMap<u64, Vec<u8>>,
    what: &str,
) -> BTreeMap<u64, Vec<u8>> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let read = rt.block_on(read_all(c, stream, acked.keys().next_back().unwrap() + 1));
    check_nothing_lost(acked, &read);
    let mut payloads: Vec<_> = read.values().collect();
    let total = payloads.len();
    payloads.sort();
    payloads.dedup();
    assert_eq!(payloads.len(), total, "no {what} in the log twice");
    read
}

/// Asks the control plane to move shard 0 of `name` (`kind`: stream or cache) to
/// `node-{to}`.
fn move_shard(c: &TestCluster, kind: &str, name: &str, to: usize) {
    c.admin
        .post(
            "/v1/shard-moves",
            &serde_json::json!({"tenant_id": TENANT, "namespace": NAMESPACE, "stream": name,
                "kind": kind, "shard": 0, "destination": format!("node-{to}")}),
        )
        .unwrap();
}

fn check_nothing_lost(acked: &BTreeMap<u64, Vec<u8>>, read: &BTreeMap<u64, Vec<u8>>) {
    for (o, p) in acked {
        match read.get(o) {
            Some(have) if have == p => {}
            other => panic!(
                "acknowledged offset {o} ({:?}) reads back as {:?}",
                String::from_utf8_lossy(p),
                other.map(|v| String::from_utf8_lossy(v).into_owned())
            ),
        }
    }
}

#[test]
fn a_quorum_leader_killed_under_load_loses_nothing_it_acknowledged() {
    let mut c = cluster();
    c.create_stream("q", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("q", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let acked: Acked = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Load before, across and after the kill.
    let publisher = {
        let c = &c;
        std::thread::scope(|s| {
            let (acked2, stop2) = (acked.clone(), stop.clone());
            let h = s.spawn(move || {
                tokio::runtime::Runtime::new()
                    .unwrap()
                    .block_on(publish_until(c, "q", "a", acked2, stop2))
            });
            // Let it write a while, then kill the leader.
            wait_for("acked writes", Duration::from_secs(30), || {
                (acked.lock().unwrap().len() >= 50).then_some(())
            })
            .unwrap();
            let at_kill = acked.lock().unwrap().len();
            c.brokers[leader].signal(libc::SIGKILL);
            let killed = Instant::now();
            let (successor, _) = c
                .wait_leader("q", 0, Some(leader), generation, Duration::from_secs(30))
                .unwrap();
            wait_for("writes acknowledged again", Duration::from_secs(30), || {
                (acked.lock().unwrap().len() > at_kill + 20).then_some(())
            })
            .unwrap();
            eprintln!(
                "failover: node-{leader} killed after {at_kill} acks; node-{successor} serving again {:?} later",
                killed.elapsed()
            );
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            h.join().unwrap()
        })
    };
    eprintln!("publishes that failed or timed out (not acknowledged): {publisher}");
    let acked = acked.lock().unwrap().clone();
    let read = rt.block_on(read_all(
        &c,
        "q",
        acked.keys().next_back().map_or(0, |o| o + 1),
    ));
    check_nothing_lost(&acked, &read);
    // The killed broker comes back as a follower and catches up.
    c.brokers[leader].restart().unwrap();
    let end = *read.keys().next_back().unwrap() + 1;
    wait_for(
        "the old leader to catch up",
        Duration::from_secs(30),
        || {
            let r = c.admin.get("/v1/placement/replication").ok()?;
            let shard = r["items"]
                .as_array()?
                .iter()
                .find(|i| i["name"] == "q")?
                .clone();
            let me = shard["members"]
                .as_array()?
                .iter()
                .find(|m| m["node_id"] == format!("node-{leader}").as_str())?
                .clone();
            (me["position"].as_u64()? >= end).then_some(())
        },
    )
    .unwrap();
}

#[test]
fn a_leader_paused_past_its_lease_acknowledges_nothing_after_it_wakes() {
    let c = cluster();
    c.create_stream("p", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("p", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let acked: Acked = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // One client talks to the leader alone (its publishes stall while it is paused and
    // are answered when it wakes); another goes wherever the cluster sends it.
    let direct: Acked = Arc::default();
    std::thread::scope(|s| {
        let (a, st) = (acked.clone(), stop.clone());
        let cref = &c;
        let h = s.spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(publish_until(cref, "p", "cluster", a, st))
        });
        let (d, st) = (direct.clone(), stop.clone());
        let leader_addr = c.brokers[leader].listen;
        let config = c.client_config().unwrap();
        let d2 = s.spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move {
                    let client = felix_client::Client::connect(leader_addr, "localhost", config)
                        .await
                        .unwrap();
                    let mut i = 0;
                    // Several in flight at any time: some are queued when the pause comes.
                    let mut inflight = Vec::new();
                    while !st.load(std::sync::atomic::Ordering::SeqCst) {
                        while inflight.len() < 8 {
                            let payload = format!("direct-{i}").into_bytes();
                            i += 1;
                            let client = client.clone();
                            inflight.push(tokio::spawn(async move {
                                let r = client
                                    .publish(
                                        TENANT,
                                        NAMESPACE,
                                        "p",
                                        payload.clone(),
                                        AckMode::PerMessage,
                                    )
                                    .await;
                                (payload, r)
                            }));
                        }
                        let (done, _, rest) = futures_select(inflight).await;
                        inflight = rest;
                        if let Ok((payload, Ok(Some(o)))) = done {
                            d.lock().unwrap().insert(o, payload);
                        }
                    }
                })
        });
        wait_for("acked writes", Duration::from_secs(30), || {
            (acked.lock().unwrap().len() >= 30).then_some(())
        })
        .unwrap();
        c.brokers[leader].signal(libc::SIGSTOP);
        let (successor, _) = c
            .wait_leader("p", 0, Some(leader), generation, Duration::from_secs(30))
            .unwrap();
        let at = acked.lock().unwrap().len();
        wait_for(
            "the successor acknowledges",
            Duration::from_secs(30),
            || (acked.lock().unwrap().len() > at + 20).then_some(()),
        )
        .unwrap();
        let direct_before = direct.lock().unwrap().len();
        c.brokers[leader].signal(libc::SIGCONT);
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        eprintln!(
            "node-{leader} paused, node-{successor} took over; direct acks before the pause {direct_before}, after {}",
            direct.lock().unwrap().len()
        );
        h.join().unwrap();
        let _ = d2.join();
    });
    let mut all = acked.lock().unwrap().clone();
    for (o, p) in direct.lock().unwrap().iter() {
        if let Some(other) = all.insert(*o, p.clone()) {
            assert_eq!(&other, p, "offset {o} acknowledged with two values");
        }
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let read = rt.block_on(read_all(
        &c,
        "p",
        all.keys().next_back().map_or(0, |o| o + 1),
    ));
    check_nothing_lost(&all, &read);
}

/// A broker cut off from the control plane past its lease refuses writes; once the
/// control plane answers again it must take them within about a heartbeat, not when
/// its assignment feed's long poll next ends (up to 2 s later: it did wait for that).
/// The lease here is long enough (3 s, so 2.25 s held and the broker declared down only
/// after 3.75 s) that the cut heals well before the control plane gives up on the node.
#[test]
fn a_broker_whose_lease_lapsed_takes_writes_again_within_a_heartbeat_of_reaching_the_control_plane()
{
    use felix_cluster::proxy::{Link, Party};
    let c = one_broker_with_a_short_lease();
    c.create_stream("lapse", 1, 1, "Quorum").unwrap();
    c.wait_leader("lapse", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let incarnation = || c.admin.get("/v1/nodes/node-0").unwrap()["incarnation"].clone();
    let before = incarnation();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[0].listen, c.client_config().unwrap());
    let client = rt
        .block_on(felix_client::Client::connect(addr, "localhost", config))
        .unwrap();
    // One publish: acknowledged within 300 ms (`Some(true)`), refused because the lease
    // lapsed (`Some(false)`), or anything else.
    let publish = |i: usize| {
        rt.block_on(async {
            let sent = client.publish(
                TENANT,
                NAMESPACE,
                "lapse",
                format!("r-{i}").into_bytes(),
                AckMode::PerMessage,
            );
            match tokio::time::timeout(Duration::from_millis(300), sent).await {
                Ok(Ok(Some(_))) => Some(true),
                Ok(Err(felix_client::ClientError::Broker(b))) if b.message.contains("stale") => {
                    Some(false)
                }
                _ => None,
            }
        })
    };
    let mut i = 0;
    wait_for("a first write", Duration::from_secs(20), || {
        i += 1;
        (publish(i) == Some(true)).then_some(())
    })
    .unwrap();
    rules.set_both(Party::Node(0), Party::ControlPlane, Link::cut());
    let cut = Instant::now();
    wait_for("the lease to lapse", Duration::from_secs(5), || {
        i += 1;
        let refused = publish(i) == Some(false);
        std::thread::sleep(Duration::from_millis(20));
        refused.then_some(())
    })
    .unwrap();
    let lapsed = cut.elapsed();
    rules.heal();
    let healed = Instant::now();
    wait_for("writes again", Duration::from_secs(10), || {
        i += 1;
        let taken = publish(i) == Some(true);
        std::thread::sleep(Duration::from_millis(20));
        taken.then_some(())
    })
    .unwrap();
    let resumed = healed.elapsed();
    eprintln!("lease lapsed {lapsed:?} after the cut; writes again {resumed:?} after it healed");
    assert_eq!(
        incarnation(),
        before,
        "the control plane declared the node down: the cut lasted too long to test a lapse"
    );
    assert!(
        resumed < Duration::from_millis(1200),
        "writes resumed only {resumed:?} after the control plane was reachable again"
    );
}

/// A broker whose lease lapsed answers no request of an unreplicated cache, as it
/// takes no publish: the control plane may have placed the cache elsewhere (an
/// operator's abandon), and its puts and counter adds would be acknowledged where the
/// new owner never sees them, its gets answered from a copy that is no longer the
/// cache's. (Caches took no look at the lease, while streams and groups did.)
#[test]
fn a_broker_whose_lease_lapsed_answers_no_request_of_an_unreplicated_cache() {
    use felix_cluster::proxy::{Link, Party};
    let c = one_broker_with_a_short_lease();
    c.admin
        .post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/caches"),
            &serde_json::json!({"cache": "solo", "shards": 1, "replication_factor": 1}),
        )
        .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[0].listen, c.client_config().unwrap());
    let client = rt
        .block_on(felix_client::Client::connect(addr, "localhost", config))
        .unwrap();
    let stale = |e: &felix_client::ClientError| matches!(e, felix_client::ClientError::Broker(b) if b.message.contains("stale"));
    rt.block_on(put_until_taken(&client, "solo", b"one"));
    rules.set_both(Party::Node(0), Party::ControlPlane, Link::cut());
    // Puts until one is refused `stale`: the lease lapsed (taken every time, the wait
    // gave up).
    let lapsed = wait_for("the lease to lapse", Duration::from_secs(5), || {
        let put = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_millis(300),
                client.cache_put(
                    TENANT,
                    NAMESPACE,
                    "solo",
                    "k",
                    bytes::Bytes::from_static(b"two"),
                    None,
                ),
            )
            .await
        });
        std::thread::sleep(Duration::from_millis(20));
        match put {
            Ok(Err(e)) if stale(&e) => Some(()),
            _ => None,
        }
    });
    let (get, add) = rt.block_on(async {
        tokio::join!(
            client.cache_get(TENANT, NAMESPACE, "solo", "k"),
            client.counter_add(TENANT, NAMESPACE, "solo", "n", 1),
        )
    });
    rules.heal();
    assert!(lapsed.is_ok(), "puts were taken past the lease");
    assert!(
        matches!(&get, Err(e) if stale(e)),
        "a get answered: {get:?}"
    );
    assert!(matches!(&add, Err(e) if stale(e)), "an add taken: {add:?}");
}

/// A Quorum cache write whose majority did not answer in time is answered
/// outcome-unknown, but it is in the leader's log and commits once the followers are
/// back: the leader's index must then have it, as every replica's log does. It did
/// not (the index applied a write only when its own request saw it commit): `get`
/// kept answering the old value and counters their old sum, while watchers, reading
/// the log, saw the new one.
#[test]
fn a_quorum_cache_write_answered_outcome_unknown_reaches_the_index_when_it_commits() {
    use felix_cluster::proxy::{Link, Party};
    let c = proxied_cluster();
    create_quorum_cache(&c, "cut");
    let (leader, _) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", None)
    })
    .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[leader].listen, c.client_config().unwrap());
    let client = rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        // Written until the cache serves (its first generation starts).
        put_until_taken(&client, "cut", b"one").await;
        assert_eq!(
            client
                .counter_add(TENANT, NAMESPACE, "cut", "n", 5)
                .await
                .unwrap(),
            5
        );
        client
    });
    for f in (0..3).filter(|&i| i != leader) {
        rules.set_both(Party::Node(leader), Party::Node(f), Link::cut());
    }
    let (put, add) = rt.block_on(async {
        let in_time = Duration::from_secs(10);
        tokio::join!(
            tokio::time::timeout(
                in_time,
                client.cache_put(
                    TENANT,
                    NAMESPACE,
                    "cut",
                    "k",
                    bytes::Bytes::from_static(b"two"),
                    None
                )
            ),
            tokio::time::timeout(
                in_time,
                client.counter_add(TENANT, NAMESPACE, "cut", "n", 7)
            ),
        )
    });
    assert!(
        !matches!(put, Ok(Ok(()))) && !matches!(add, Ok(Ok(_))),
        "with no follower reachable the writes cannot be acknowledged: {put:?} {add:?}"
    );
    rules.heal();
    let got = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let value = client.cache_get(TENANT, NAMESPACE, "cut", "k").await;
            let sum = client.counter_get(TENANT, NAMESPACE, "cut", "n").await;
            if let (Ok(Some(v)), Ok(Some(12))) = (&value, &sum)
                && v.as_ref() == b"two"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("after the heal: value {value:?}, sum {sum:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    got.unwrap();
}

/// Writes of a key queued behind one that never settles (no follower reachable, so
/// its majority never comes) give up when it does, not each after a wait of its own:
/// three deletes, one per connection, waited for the put in turn, 5 s each (the last
/// answered 15 s after the put, or timed out first); they are now all answered about
/// when the put gives up.
#[test]
fn writes_queued_behind_an_unsettled_one_give_up_with_it() {
    use felix_cluster::proxy::{Link, Party};
    let c = proxied_cluster();
    create_quorum_cache(&c, "queue");
    let (leader, _) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", None)
    })
    .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = c.brokers[leader].listen;
    let mut config = c.client_config().unwrap();
    config.request_timeout = Duration::from_secs(30);
    let connect = || felix_client::Client::connect(addr, "localhost", config.clone());
    let answered = rt.block_on(async {
        let first = connect().await.unwrap();
        put_until_taken(&first, "queue", b"one").await;
        let mut deleters = Vec::new();
        for _ in 0..3 {
            deleters.push(connect().await.unwrap());
        }
        for f in (0..3).filter(|&i| i != leader) {
            rules.set_both(Party::Node(leader), Party::Node(f), Link::cut());
        }
        let started = Instant::now();
        let put = first.cache_put(
            TENANT,
            NAMESPACE,
            "queue",
            "k",
            bytes::Bytes::from_static(b"two"),
            None,
        );
        let deletes = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let tasks: Vec<_> = deleters
                .into_iter()
                .map(|d| {
                    tokio::spawn(async move {
                        let r = d.cache_delete(TENANT, NAMESPACE, "queue", "k").await;
                        (started.elapsed(), r.map(|_| ()))
                    })
                })
                .collect();
            let mut answered = Vec::new();
            for t in tasks {
                answered.push(t.await.unwrap());
            }
            answered
        };
        let (put, deletes) = tokio::join!(put, deletes);
        assert!(put.is_err(), "no follower reachable: {put:?}");
        deletes
    });
    rules.heal();
    for (after, r) in &answered {
        eprintln!("a queued delete answered {after:?} after the put: {r:?}");
    }
    for (after, r) in answered {
        assert!(
            matches!(&r, Err(felix_client::ClientError::Broker(_))),
            "refused as the put is unsettled: {r:?}"
        );
        assert!(
            after < Duration::from_secs(9),
            "a delete waited {after:?}: queued writes waited a full wait each"
        );
    }
}

/// A publish to a Quorum stream answered outcome-unknown (no follower reachable) that
/// commits once the links heal reaches a subscriber, though nothing is written after
/// it: only an acknowledged write was fanned out, so it sat in the log unseen by
/// subscribers and group polls (`stream_read` returned it) until a later write showed
/// the gap.
#[test]
fn a_quorum_publish_answered_outcome_unknown_reaches_subscribers_when_it_commits() {
    use felix_cluster::proxy::{Link, Party};
    let c = proxied_cluster();
    c.create_stream("unk", 1, 3, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("unk", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[leader].listen, c.client_config().unwrap());
    let (client, mut sub) = rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        // Written until the stream serves (its first generation starts).
        let deadline = Instant::now() + Duration::from_secs(20);
        let first = loop {
            match client
                .publish(
                    TENANT,
                    NAMESPACE,
                    "unk",
                    b"one".to_vec(),
                    AckMode::PerMessage,
                )
                .await
            {
                Ok(Some(o)) => break o,
                r if Instant::now() < deadline => {
                    eprintln!("not taken yet: {r:?}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => panic!("the stream never took a write: {r:?}"),
            }
        };
        let mut sub = client
            .subscribe_from(
                TENANT,
                NAMESPACE,
                "unk",
                Some(StartPosition::Offset(felix_wire::Offset(first))),
            )
            .await
            .unwrap();
        let e = tokio::time::timeout(Duration::from_secs(10), sub.next_event())
            .await
            .expect("the first record")
            .unwrap()
            .unwrap();
        assert_eq!(e.payload.as_ref(), b"one");
        (client, sub)
    });
    for f in (0..3).filter(|&i| i != leader) {
        rules.set_both(Party::Node(leader), Party::Node(f), Link::cut());
    }
    let unknown = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(10),
            client.publish(
                TENANT,
                NAMESPACE,
                "unk",
                b"two".to_vec(),
                AckMode::PerMessage,
            ),
        )
        .await
    });
    assert!(
        !matches!(unknown, Ok(Ok(Some(_)))),
        "with no follower reachable the write cannot be acknowledged: {unknown:?}"
    );
    rules.heal();
    let e = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(15), sub.next_event()).await })
        .expect("the write reaches the subscriber once it commits")
        .unwrap()
        .unwrap();
    assert_eq!(e.payload.as_ref(), b"two");
}

/// A group delete answered `unacknowledged` (no follower reachable) stays in the log,
/// and the leader's groups follow the log: the group is gone once the links heal, as a
/// rebuild from the log has it. Before, the delete was applied nowhere in memory: the
/// group served on at its cursor, and a rebuild (a restart, a failover) dropped it and
/// made it again from the acks after the delete, from offset 0.
#[test]
fn a_quorum_group_delete_answered_outcome_unknown_is_applied_as_the_log_has_it() {
    use felix_client::{GroupRef, PollOptions};
    use felix_cluster::proxy::{Link, Party};
    let c = proxied_cluster();
    c.create_stream("gunk", 1, 3, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("gunk", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[leader].listen, c.client_config().unwrap());
    let g = GroupRef::new(TENANT, NAMESPACE, "gunk", 0, "g");
    let client = rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        publish_until_taken(&client, "gunk", "one").await;
        let got = client
            .group_poll(
                &g,
                PollOptions {
                    max_records: 10,
                    wait: Duration::from_secs(5),
                    visibility: None,
                },
            )
            .await
            .unwrap();
        for r in &got {
            client.group_ack(&g, r.offset.0).await.unwrap();
        }
        let info = client.group_describe(&g).await.unwrap();
        assert!(info.committed.is_some_and(|c| c > 0), "{info:?}");
        client
    });
    for f in (0..3).filter(|&i| i != leader) {
        rules.set_both(Party::Node(leader), Party::Node(f), Link::cut());
    }
    let unknown = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), client.group_delete(&g)).await
    });
    assert!(
        !matches!(unknown, Ok(Ok(_))),
        "with no follower reachable the delete cannot be acknowledged: {unknown:?}"
    );
    eprintln!("delete answered: {unknown:?}");
    rules.heal();
    let gone = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match client.group_describe(&g).await {
                Ok(info) => break info,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("not served yet: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("the group is never described: {e}"),
            }
        }
    });
    assert_eq!(
        gone.committed, None,
        "the deleted group serves on: {gone:?}"
    );
}

/// A delete that arrives while a put of its key is still replicating must remove
/// what the put writes: the put is first in the log. The index holds a Quorum write
/// only once it commits, so a delete that looked there first found nothing, wrote
/// nothing, was answered, and the put committed after it. Here both followers' links
/// are slowed (250 ms each way) so the put is in flight for at least half a second,
/// and the delete is sent on another connection 200 ms after it (the put reaches the
/// leader directly, in well under that).
#[test]
fn a_quorum_cache_delete_removes_a_put_of_its_key_still_replicating() {
    use felix_cluster::proxy::{Link, Party};
    let c = proxied_cluster();
    create_quorum_cache(&c, "del");
    let (leader, _) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", Some("del"))
    })
    .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[leader].listen, c.client_config().unwrap());
    rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config.clone())
            .await
            .unwrap();
        // A second connection: one connection's requests are served in turn.
        let other = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        put_until_taken(&client, "del", b"first").await;
        client
            .cache_delete(TENANT, NAMESPACE, "del", "k")
            .await
            .unwrap();
        let slow = Link {
            delay: Duration::from_millis(250),
            ..Link::default()
        };
        for f in (0..3).filter(|&i| i != leader) {
            rules.set_both(Party::Node(leader), Party::Node(f), slow);
        }
        let put = client.cache_put(
            TENANT,
            NAMESPACE,
            "del",
            "k",
            bytes::Bytes::from_static(b"second"),
            None,
        );
        let delete = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            other.cache_delete(TENANT, NAMESPACE, "del", "k").await
        };
        let (put, deleted) = tokio::join!(put, delete);
        put.unwrap();
        assert_eq!(
            deleted.unwrap().as_deref(),
            Some(&b"second"[..]),
            "the delete answers the value it removed"
        );
        assert_eq!(
            client
                .cache_get(TENANT, NAMESPACE, "del", "k")
                .await
                .unwrap(),
            None,
            "a put acknowledged before its delete outlived it"
        );
    });
    rules.heal();
}

/// Creates `name`, a one-shard Quorum cache of three copies.
fn create_quorum_cache(c: &TestCluster, name: &str) {
    c.admin
        .post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/caches"),
            &serde_json::json!({"cache": name, "shards": 1, "replication_factor": 3, "consistency": "Quorum"}),
        )
        .unwrap();
}

/// Writes of one key pipelined on a stream land in the order sent on a replicated
/// cache too: there a delete waits for the key's earlier writes as conditional writes
/// do, and a put sent after it claimed first; the delete then removed the acknowledged
/// put. See [`felix_cluster::writes_of_one_key_in_order`].
#[test]
fn pipelined_writes_of_one_key_land_in_order_on_a_quorum_cache() {
    let c = cluster();
    create_quorum_cache(&c, "ordered");
    let (leader, _) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", Some("ordered"))
    })
    .unwrap();
    let config = c.client_config().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Serving once its first generation starts.
    rt.block_on(async {
        let client = felix_client::Client::connect(c.brokers[leader].listen, "localhost", config)
            .await
            .unwrap();
        put_until_taken(&client, "ordered", b"v0").await;
    });
    let (lo, hi) = felix_wire::Features::ERROR_CODES
        .union(felix_wire::Features::CACHE_CONDITIONAL)
        .offer();
    let auth = felix_wire::Message::Auth {
        tenant_id: TENANT.into(),
        token: c.client_token.clone(),
        client_flags: Some(0x1FFF),
        client_features: lo,
        client_features_hi: hi,
    }
    .to_frame();
    for round in 0..5 {
        let outcome = rt.block_on(felix_cluster::writes_of_one_key_in_order(
            c.brokers[leader].listen,
            &c.certs.ca,
            auth.clone(),
            (TENANT, NAMESPACE, "ordered"),
        ));
        assert_eq!(
            outcome,
            felix_cluster::WRITES_OF_ONE_KEY_IN_ORDER,
            "round {round}"
        );
    }
}

/// A broker told to stop (SIGTERM) is not ready from the moment it drains: it turns new
/// connections away from then on, and `/readyz` said ready until it exited (up to the
/// drain's 15 s and the stop after it), so a load balancer kept sending clients there.
#[test]
fn a_draining_broker_is_not_ready() {
    let mut c = cluster();
    c.create_stream("drained", 1, 3, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("drained", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let http = c.brokers[leader].http.to_string();
    let readyz = || felix_client::ops::http(&http, "GET", "/readyz", None);
    assert_eq!(readyz().unwrap().0, 200);
    let seen = std::thread::scope(|s| {
        let stopping = s.spawn(|| c.brokers[leader].terminate(Duration::from_secs(30)));
        let mut seen = None;
        while !stopping.is_finished() {
            match readyz() {
                Ok((503, body)) => {
                    seen = Some(body);
                    break;
                }
                Ok(_) => std::thread::sleep(Duration::from_millis(2)),
                Err(_) => break,
            }
        }
        assert!(stopping.join().unwrap(), "it stopped cleanly");
        seen
    });
    let body = seen.expect("not ready before it exited");
    assert!(
        body.contains("draining") || body.contains("stopping"),
        "{body}"
    );
}

/// Puts `value` at key `k` of `cache` through `client` until it is taken (a new cache
/// serves once its first generation starts; a successor once it took over), for 20 s.
async fn put_until_taken(client: &felix_client::Client, cache: &str, value: &'static [u8]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Err(e) = client
        .cache_put(
            TENANT,
            NAMESPACE,
            cache,
            "k",
            bytes::Bytes::from_static(value),
            None,
        )
        .await
    {
        assert!(
            Instant::now() < deadline,
            "the put to {cache} was never taken: {e}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the shard named `name` has, within 5 s, a generation past `old` whose start
/// is committed (`/v1/placement/replication`).
fn generation_committed_past(c: &TestCluster, name: &str, old: u64) -> bool {
    wait_for(
        "the new leader's generation committed",
        Duration::from_secs(5),
        || {
            let view = c.admin.get("/v1/placement/replication").ok()?;
            let shard = view["items"]
                .as_array()?
                .iter()
                .find(|i| i["name"] == name)?
                .clone();
            (shard["report"]["generation"].as_u64()? > old
                && shard["report"]["generation_committed"] == true)
                .then_some(())
        },
    )
    .is_ok()
}

/// A new leader of a Quorum cache rebuilds its index from its whole log, which may hold
/// records a majority does not (the furthest copy's, its predecessor's last writes):
/// it answers reads from it only once its generation start is committed (a read
/// index), as `state_get` does. Here the two followers' links are slowed (150 ms each
/// way) before the leader is killed, so the new leader serves ~150 ms before its
/// generation start reaches the other; the moment a read is first answered, the link
/// between them is cut. A read answered then (it was, before the fix) leaves the
/// generation uncommitted for good: the view says whether it committed.
#[test]
fn a_new_quorum_cache_leader_answers_reads_only_once_its_generation_is_committed() {
    use felix_cluster::proxy::{Link, Party};
    let mut c = proxied_cluster();
    create_quorum_cache(&c, "ri");
    let (old, old_generation) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", Some("ri"))
    })
    .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = c.client_config().unwrap();
    let others: Vec<usize> = (0..3).filter(|&i| i != old).collect();
    let clients = rt.block_on(async {
        let old_client =
            felix_client::Client::connect(c.brokers[old].listen, "localhost", config.clone())
                .await
                .unwrap();
        put_until_taken(&old_client, "ri", b"v").await;
        let mut clients = Vec::new();
        for &b in &others {
            let client =
                felix_client::Client::connect(c.brokers[b].listen, "localhost", config.clone())
                    .await
                    .unwrap();
            clients.push((b, client));
        }
        clients
    });
    let slow = Link {
        delay: Duration::from_millis(150),
        ..Link::default()
    };
    rules.set_both(Party::Node(others[0]), Party::Node(others[1]), slow);
    c.brokers[old].kill();
    // The first read a survivor answers, asking both at once (the follower forwards to
    // the leader over their slowed link: its answer comes a round trip later).
    async fn answered(client: &felix_client::Client, deadline: Instant) {
        while client
            .cache_get(TENANT, NAMESPACE, "ri", "k")
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "no survivor answered a read");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        tokio::select! {
            () = answered(&clients[0].1, deadline) => {}
            () = answered(&clients[1].1, deadline) => {}
        }
    });
    // Whatever is still on its way between them (the generation start, its
    // acknowledgement) is lost from now on.
    rules.set_both(Party::Node(others[0]), Party::Node(others[1]), Link::cut());
    assert!(
        generation_committed_past(&c, "ri", old_generation),
        "a read was answered before the new leader's generation start was committed: {:?}",
        c.admin.get("/v1/placement/replication").ok()
    );
    rules.heal();
    let _ = &mut c;
}

/// A new leader of a Quorum stream builds its consumer groups from its log, which may
/// hold group events a majority does not (the furthest copy's, its predecessor's last
/// acks): it answers group requests only once its generation start is committed, as
/// reads of caches and state do. Before, it answered a retried ack `done` from such an
/// event, and a second failure could then cut it: an acknowledged ack lost, its record
/// delivered again. Set up as
/// [`a_new_quorum_cache_leader_answers_reads_only_once_its_generation_is_committed`]: the
/// followers' link slowed before the leader is killed, cut the moment a survivor first
/// answers a group request; answered too early, the new generation never commits.
#[test]
fn a_new_quorum_stream_leader_serves_groups_only_once_its_generation_is_committed() {
    use felix_client::{GroupRef, PollOptions};
    use felix_cluster::proxy::{Link, Party};
    let mut c = proxied_cluster();
    c.create_stream("gq", 1, 3, "Quorum").unwrap();
    let (old, old_generation) = wait_for("a stream leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "stream", Some("gq"))
    })
    .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = c.client_config().unwrap();
    let others: Vec<usize> = (0..3).filter(|&i| i != old).collect();
    let g = GroupRef::new(TENANT, NAMESPACE, "gq", 0, "w");
    let clients = rt.block_on(async {
        let old_client =
            felix_client::Client::connect(c.brokers[old].listen, "localhost", config.clone())
                .await
                .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while let Err(e) = old_client
            .publish(TENANT, NAMESPACE, "gq", b"r".to_vec(), AckMode::PerMessage)
            .await
        {
            assert!(Instant::now() < deadline, "no publish taken: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let poll = PollOptions {
            max_records: 1,
            wait: Duration::from_secs(5),
            visibility: None,
        };
        let got = old_client.group_poll(&g, poll).await.unwrap();
        old_client.group_ack(&g, got[0].offset.0).await.unwrap();
        let mut clients = Vec::new();
        for &b in &others {
            let client =
                felix_client::Client::connect(c.brokers[b].listen, "localhost", config.clone())
                    .await
                    .unwrap();
            clients.push(client);
        }
        clients
    });
    let slow = Link {
        delay: Duration::from_millis(150),
        ..Link::default()
    };
    rules.set_both(Party::Node(others[0]), Party::Node(others[1]), slow);
    c.brokers[old].kill();
    async fn answered(client: &felix_client::Client, g: &GroupRef, deadline: Instant) {
        while client.group_describe(g).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "no survivor answered a group request"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        tokio::select! {
            () = answered(&clients[0], &g, deadline) => {}
            () = answered(&clients[1], &g, deadline) => {}
        }
    });
    rules.set_both(Party::Node(others[0]), Party::Node(others[1]), Link::cut());
    assert!(
        generation_committed_past(&c, "gq", old_generation),
        "a group request was answered before the new leader's generation start was committed: {:?}",
        c.admin.get("/v1/placement/replication").ok()
    );
    rules.heal();
    let _ = &mut c;
}

/// A Quorum cache's leader paused past its lease, its successor taking a put meanwhile:
/// woken, it still thinks it leads until it reads the assignments again, and must not
/// answer a read from before the put (it did: reads checked no lease). Reads sent to it
/// while it is paused are answered as it wakes, racing its first look at the
/// assignments.
#[test]
fn a_cache_leader_paused_past_its_lease_answers_no_read_from_before_its_successor() {
    let c = cluster();
    create_quorum_cache(&c, "lp");
    let (old, generation) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", Some("lp"))
    })
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = c.client_config().unwrap();
    let direct = rt.block_on(async {
        let client =
            felix_client::Client::connect(c.brokers[old].listen, "localhost", config.clone())
                .await
                .unwrap();
        put_until_taken(&client, "lp", b"one").await;
        Arc::new(client)
    });
    c.brokers[old].signal(libc::SIGSTOP);
    let (successor, _) = wait_for("a successor", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", Some("lp")).filter(|&(l, g)| l != old && g > generation)
    })
    .unwrap();
    rt.block_on(async {
        let client =
            felix_client::Client::connect(c.brokers[successor].listen, "localhost", config)
                .await
                .unwrap();
        put_until_taken(&client, "lp", b"two").await;
    });
    // Reads sent to the paused broker (the first reaches it; the client sends the rest
    // one after another), then it wakes.
    let reads: Vec<_> = (0..8)
        .map(|_| {
            let client = direct.clone();
            rt.spawn(async move {
                tokio::time::timeout(
                    Duration::from_secs(10),
                    client.cache_get(TENANT, NAMESPACE, "lp", "k"),
                )
                .await
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    c.brokers[old].signal(libc::SIGCONT);
    let mut answered = 0;
    for read in reads {
        let got = rt.block_on(read).unwrap();
        assert!(
            !matches!(&got, Ok(Ok(Some(v))) if v.as_ref() == b"one"),
            "the woken leader answered the value from before its successor's put: {got:?}"
        );
        answered += usize::from(answered_by_the_broker(&got));
    }
    assert!(answered > 0, "no read reached the woken broker");
}

/// The same for `stream_read` on a `Leader` stream, which reads to the log's end: a
/// leader paused past its lease while its successor takes a publish must not answer,
/// once woken, a read that passes over the successor's record (it did: reads checked
/// neither the lease nor whether the copy served).
#[test]
fn a_stream_leader_paused_past_its_lease_answers_no_read_without_its_successors_records() {
    let c = cluster();
    c.create_stream("lr", 1, 3, "Leader").unwrap();
    let (old, generation) = wait_for("a stream leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "stream", Some("lr"))
    })
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = c.client_config().unwrap();
    let connect = |i: usize| {
        let (addr, config) = (c.brokers[i].listen, config.clone());
        async move {
            felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap()
        }
    };
    let direct = rt.block_on(async {
        let client = connect(old).await;
        publish_until_taken(&client, "lr", "one").await;
        Arc::new(client)
    });
    c.brokers[old].signal(libc::SIGSTOP);
    let (successor, _) = wait_for("a successor", Duration::from_secs(20), || {
        leader_and_generation(&c, "stream", Some("lr")).filter(|&(l, g)| l != old && g > generation)
    })
    .unwrap();
    let two =
        rt.block_on(async { publish_until_taken(&connect(successor).await, "lr", "two").await });
    // Reads sent to the paused broker, answered as it wakes.
    let reads: Vec<_> = (0..8)
        .map(|_| {
            let client = direct.clone();
            rt.spawn(async move {
                tokio::time::timeout(
                    Duration::from_secs(10),
                    client.stream_read(TENANT, NAMESPACE, "lr", 0, 0, None, Some(100)),
                )
                .await
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    c.brokers[old].signal(libc::SIGCONT);
    let mut answered = 0;
    for read in reads {
        let got = rt.block_on(read).unwrap();
        if let Ok(Ok((records, _))) = &got {
            assert!(
                records
                    .iter()
                    .any(|r| r.offset.0 == two && r.payload.as_ref() == b"two"),
                "the woken leader answered a read without its successor's record at {two}: {records:?}"
            );
        }
        answered += usize::from(answered_by_the_broker(&got));
    }
    assert!(answered > 0, "no read reached the woken broker");
}

/// Whether a read sent to a paused broker was answered by it (a value, or a refusal
/// such as `stale`), not lost with a connection that timed out while it was paused.
fn answered_by_the_broker<T>(
    got: &Result<Result<T, felix_client::ClientError>, tokio::time::error::Elapsed>,
) -> bool {
    matches!(
        got,
        Ok(Ok(_))
            | Ok(Err(felix_client::ClientError::Broker(_)))
            | Ok(Err(felix_client::ClientError::NotLeader(_)))
    )
}

/// Publishes `payload` through `client` until a broker acknowledges it; its offset.
async fn publish_until_taken(client: &felix_client::Client, stream: &str, payload: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match client
            .publish(
                TENANT,
                NAMESPACE,
                stream,
                payload.into(),
                AckMode::PerMessage,
            )
            .await
        {
            Ok(Some(offset)) => return offset,
            other => assert!(
                Instant::now() < deadline,
                "the publish to {stream} was never taken: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A leader killed and restarted at once comes back in its own generation (or a
/// successor takes over): either way its history must reach a new subscriber with no
/// new write to carry it. (It did not: the fanout frontier stayed at the commit mark
/// known at restart, and history reads stop at that frontier.)
#[test]
fn a_restarted_leader_serves_its_history_to_new_subscribers_without_new_writes() {
    let mut c = cluster();
    c.create_stream("h", 1, 3, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("h", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let acked = rt.block_on(async {
        let client = felix_client::ClusterClient::connect(
            &c.seeds(),
            "localhost",
            c.client_config().unwrap(),
        )
        .await
        .unwrap();
        let mut acked = BTreeMap::new();
        for i in 0..20 {
            let payload = format!("h-{i}").into_bytes();
            let o = client
                .publish_at_least_once(TENANT, NAMESPACE, "h", payload.clone(), AckMode::PerMessage)
                .await
                .unwrap()
                .unwrap();
            acked.insert(o, payload);
        }
        acked
    });
    c.brokers[leader].restart().unwrap();
    let read = rt.block_on(read_all(
        &c,
        "h",
        acked.keys().next_back().map_or(0, |o| o + 1),
    ));
    check_nothing_lost(&acked, &read);
}

/// A subscribe opened the moment its stream is created, before the brokers have heard
/// of it and its new shard's leader serves, waits for it — the protocol has a
/// `ClusterClient` retry retryable refusals (a stream not found yet, within a grace;
/// `not_assigned`; `not_ready`) when it opens a shard — instead of failing; then it
/// delivers. (Our `subscribe_shard` made one attempt: with it this fails "stream
/// acme/payments/early not found", and the chaos harness's `delete-recreate` read-back
/// once failed on it in CI, "subscribe: shard unavailable: not_ready".)
#[test]
fn a_subscribe_opened_before_its_new_shard_serves_waits_for_it() {
    let c = cluster();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = felix_client::ClusterClient::connect_with_policy(
            &c.seeds(),
            "localhost",
            c.client_config().unwrap(),
            felix_client::ReconnectPolicy {
                attempts: 40,
                backoff: Duration::from_millis(100),
                max_backoff: Duration::from_millis(500),
                deadline: Some(Duration::from_secs(20)),
            },
        )
        .await
        .unwrap();
        c.create_stream("early", 1, 3, "Quorum").unwrap();
        let mut sub = client
            .subscribe_shard(TENANT, NAMESPACE, "early", 0, Some(StartPosition::Earliest))
            .await
            .unwrap_or_else(|e| panic!("a subscribe before the shard serves: {e}"));
        let offset = client
            .publish_at_least_once(
                TENANT,
                NAMESPACE,
                "early",
                b"first".to_vec(),
                AckMode::PerMessage,
            )
            .await
            .unwrap();
        let e = tokio::time::timeout(Duration::from_secs(10), sub.next_event())
            .await
            .expect("delivered within 10 s")
            .unwrap()
            .expect("an event");
        assert_eq!((e.offset, &e.payload[..]), (offset, &b"first"[..]));
    });
}

/// The first of `futs` to finish, and the rest.
async fn futures_select<T>(
    futs: Vec<tokio::task::JoinHandle<T>>,
) -> (
    Result<T, tokio::task::JoinError>,
    usize,
    Vec<tokio::task::JoinHandle<T>>,
) {
    let mut futs = futs;
    loop {
        for i in 0..futs.len() {
            if futs[i].is_finished() {
                let f = futs.remove(i);
                return (f.await, i, futs);
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[test]
fn a_leader_stream_loses_at_most_the_lag_it_reported() {
    let mut c = cluster();
    c.create_stream("l", 1, 3, "Leader").unwrap();
    let (leader, generation) = c
        .wait_leader("l", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let acked: Acked = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (a, st) = (acked.clone(), stop.clone());
        let task = async { publish_until(&c, "l", "lead", a, st).await };
        let until = async {
            wait_for_async(|| acked.lock().unwrap().len() >= 200).await;
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        };
        tokio::join!(task, until);
    });
    // The lag the leader reports right before it dies is what a failover may lose.
    let lag = c.brokers[leader]
        .metric("felix_broker_replication_lag_records")
        .unwrap();
    c.brokers[leader].kill();
    let (successor, _) = c
        .wait_leader("l", 0, Some(leader), generation, Duration::from_secs(30))
        .unwrap();
    let acked = acked.lock().unwrap().clone();
    let read = rt.block_on(read_all(
        &c,
        "l",
        acked.keys().next_back().map_or(0, |o| o + 1),
    ));
    eprintln!(
        "read {} records, offsets {:?}..{:?}; acked offsets {:?}..{:?}",
        read.len(),
        read.keys().next(),
        read.keys().next_back(),
        acked.keys().next(),
        acked.keys().next_back()
    );
    let lost = acked
        .iter()
        .filter(|(o, p)| read.get(*o) != Some(*p))
        .count() as u64;
    eprintln!(
        "Leader stream: {} acked, {lost} lost in the failover to node-{successor}, lag reported {lag}",
        acked.len()
    );
    assert!(
        lost <= lag,
        "lost {lost} acknowledged records, more than the {lag} reported"
    );
    let _ = &mut c;
}

/// A planned move of a `Leader` stream loses nothing the old leader acknowledged: it
/// is up, and the new leader takes its log. The old leader's messages to the others
/// are delayed 100 ms, so the records it acknowledged just before the move reach no
/// follower before the new generation's fence; the two followers alone are a majority.
/// The new leader took the better of their logs, without the tail (16-20 of the 30
/// acknowledged records lost in runs with the wait removed); it now waits for the old
/// leader's fence first.
#[test]
fn a_planned_move_of_a_leader_stream_keeps_what_the_old_leader_acknowledged() {
    leader_tail_survives_its_handoff(|c, old| {
        let to = (old + 1) % 3;
        move_shard(c, "stream", "handoff", to);
        Some(to)
    });
}

/// The same through a drain at SIGTERM, a rolling restart's handoff. Two things lost
/// the tail, each with the other mended: a draining broker was no peer in the others'
/// views (only live ones were), so its successor could not even fence it (20 of 30
/// records lost); and it stopped as soon as its own view showed the shard led
/// elsewhere, before it had answered the fence or the fetch of its tail (30 of 30). It
/// stays a peer now, and stops once each successor reports serving.
#[test]
fn a_drain_at_sigterm_keeps_what_the_old_leader_of_a_leader_stream_acknowledged() {
    leader_tail_survives_its_handoff(|c, old| {
        c.brokers[old].signal(libc::SIGTERM);
        None
    });
}

/// A `Leader` stream on three brokers whose leader acknowledged 30 records, the last
/// 20 while its messages to the others were delayed 100 ms (a new connection from the
/// successor takes a round trip more; well within its wait); then `hand_off` (answering
/// the new leader, when it chose one): every acknowledged record is read back.
fn leader_tail_survives_its_handoff(hand_off: impl FnOnce(&TestCluster, usize) -> Option<usize>) {
    use felix_cluster::proxy::{Link, Party};
    let c = proxied_cluster();
    c.create_stream("handoff", 1, 3, "Leader").unwrap();
    let (old, generation) = c
        .wait_leader("handoff", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let at = connector(&c);
    let acked = rt.block_on(async {
        let client = at(old).await;
        let mut acked = BTreeMap::new();
        let publish = async |i: usize| {
            let body = format!("handoff-{i}").into_bytes();
            let sent = client.publish(
                TENANT,
                NAMESPACE,
                "handoff",
                body.clone(),
                AckMode::PerMessage,
            );
            sent.await.ok().flatten().map(|o| (o, body))
        };
        // Written until the shard serves, then 10 shipped as usual.
        let deadline = Instant::now() + Duration::from_secs(20);
        while acked.len() < 10 {
            assert!(Instant::now() < deadline, "the leader never served");
            acked.extend(publish(acked.len()).await);
        }
        let slow = Link {
            delay: Duration::from_millis(100),
            ..Link::default()
        };
        for f in (0..3).filter(|&n| n != old) {
            rules.set(Party::Node(old), Party::Node(f), slow);
        }
        for i in 10..30 {
            acked.extend(publish(i).await);
        }
        acked
    });
    assert_eq!(
        acked.len(),
        30,
        "every publish acknowledged by the old leader"
    );
    let chosen = hand_off(&c, old);
    let (leader, _) = c
        .wait_leader("handoff", 0, Some(old), generation, Duration::from_secs(20))
        .unwrap();
    if let Some(to) = chosen {
        assert_eq!(leader, to);
    }
    let read = rt.block_on(async {
        // The new leader serves before the delayed messages land.
        std::thread::sleep(Duration::from_millis(1_500));
        rules.heal();
        read_all(&c, "handoff", acked.keys().next_back().map_or(0, |o| o + 1)).await
    });
    let lost = acked
        .iter()
        .filter(|(o, p)| read.get(*o) != Some(*p))
        .count();
    assert_eq!(lost, 0, "acknowledged records lost in a planned handoff");
    check_nothing_lost(&acked, &read);
}

async fn wait_for_async(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn a_quorum_cache_keeps_every_acknowledged_value_and_counter_across_a_leader_kill() {
    let mut c = cluster();
    create_quorum_cache(&c, "sessions");
    let leader_of = |c: &TestCluster| leader_and_generation(c, "cache", None);
    let (leader, generation) =
        wait_for("a cache leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Through a broker that will survive: it forwards to the leader.
    let via = (leader + 1) % 3;
    let put = |c: &TestCluster, n: usize, tag: &'static str| {
        let addr = c.brokers[via].listen;
        let config = c.client_config().unwrap();
        rt.block_on(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            let client = felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap();
            let mut i = 0;
            while i < n {
                let v = bytes::Bytes::from(format!("{tag}-{i}"));
                match client
                    .cache_put(TENANT, NAMESPACE, "sessions", &format!("k{i}"), v, None)
                    .await
                {
                    Ok(()) => i += 1,
                    Err(e) => {
                        assert!(Instant::now() < deadline, "cache writes never resumed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        })
    };
    put(&c, 40, "before");
    // Counters share the cache's log and its replication: 40 adds before the kill.
    {
        let addr = c.brokers[via].listen;
        let config = c.client_config().unwrap();
        rt.block_on(async move {
            let client = felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap();
            for i in 1..=40 {
                let sum = client
                    .counter_add(TENANT, NAMESPACE, "sessions", "k0", 1)
                    .await
                    .unwrap();
                assert_eq!(sum, i);
            }
        });
    }
    c.brokers[leader].kill();
    let (successor, _) = wait_for("a new cache leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
    })
    .unwrap();
    eprintln!("cache leader node-{leader} killed, node-{successor} leads");
    // Every value written before the kill is there; writes go on.
    let addr = c.brokers[via].listen;
    let config = c.client_config().unwrap();
    rt.block_on(async move {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut i = 0;
        while i < 40 {
            match client
                .cache_get(TENANT, NAMESPACE, "sessions", &format!("k{i}"))
                .await
            {
                Ok(v) => {
                    assert_eq!(v.as_deref(), Some(format!("before-{i}").as_bytes()), "k{i}");
                    i += 1;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "cache reads never resumed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        assert_eq!(
            client
                .counter_get(TENANT, NAMESPACE, "sessions", "k0")
                .await
                .unwrap(),
            Some(40),
            "every acknowledged add survives the leader"
        );
    });
    put(&c, 10, "after");
    let _ = &mut c;
}

#[test]
fn quorum_commits_keep_their_state_and_events_across_a_leader_kill() {
    use felix_wire::message::StateChange;
    let mut c = cluster();
    c.create_stream("ledger", 1, 3, "Quorum").unwrap();
    let leader_of = |c: &TestCluster| leader_and_generation(c, "stream", Some("ledger"));
    let (leader, generation) =
        wait_for("a ledger leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    let via = (leader + 1) % 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let connect = |c: &TestCluster| {
        let (addr, config) = (c.brokers[via].listen, c.client_config().unwrap());
        async move {
            felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap()
        }
    };
    // Twenty commits through a broker that will survive (it forwards to the leader).
    let mut offsets = Vec::new();
    rt.block_on(async {
        let client = connect(&c).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut i = 0;
        while i < 20 {
            let changes = vec![StateChange::Put {
                key: "balance".into(),
                value: bytes::Bytes::from(format!("{}", i * 10)),
            }];
            match client
                .commit(
                    TENANT,
                    NAMESPACE,
                    "ledger",
                    "acct",
                    format!("event-{i}").into(),
                    changes,
                    None,
                )
                .await
            {
                Ok(o) => {
                    offsets.push(o);
                    i += 1;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "commits never went through: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        // A stale expected offset is refused and writes nothing.
        let e = client
            .commit(
                TENANT,
                NAMESPACE,
                "ledger",
                "acct",
                "stale".into(),
                vec![],
                Some(0),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("tail"), "{e}");
    });
    c.brokers[leader].kill();
    wait_for("a new ledger leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
    })
    .unwrap();
    rt.block_on(async {
        let client = connect(&c).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let last = *offsets.last().unwrap();
        loop {
            match client
                .state_get(TENANT, NAMESPACE, "ledger", "acct", "balance")
                .await
            {
                Ok((value, _)) => {
                    assert_eq!(
                        value,
                        Some((bytes::Bytes::from_static(b"190"), last)),
                        "the new leader's state holds the last acknowledged commit"
                    );
                    break;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "state reads never resumed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    // Subscribers of the new leader see every acknowledged commit's event, and only it.
    let read = rt.block_on(read_all(&c, "ledger", offsets.last().unwrap() + 1));
    for (i, o) in offsets.iter().enumerate() {
        assert_eq!(read[o], format!("event-{i}").into_bytes(), "offset {o}");
    }
    assert!(
        read.values().all(|v| v.starts_with(b"event-")),
        "readers see events only"
    );
    let _ = &mut c;
}

/// Waits until every broker's retention removed at least `segments` segments.
fn wait_retention_everywhere(c: &TestCluster, segments: u64) {
    wait_for(
        "retention on every replica",
        Duration::from_secs(30),
        || {
            c.brokers
                .iter()
                .all(|b| {
                    b.metric("felix_broker_retention_segments_removed_total")
                        .unwrap_or(0)
                        >= segments
                })
                .then_some(())
        },
    )
    .unwrap();
}

/// A Quorum stream with retention: the leader carries live state past the cut (its
/// copies replicated like any write), every replica trims its log without removing a
/// live entry's newest record, and after a leader kill the successor, folding its own
/// trimmed log, answers every key with its value and version.
#[test]
fn replicated_state_outlives_retention_on_every_replica_and_a_leader_kill() {
    use felix_wire::message::StateChange;
    let mut c = TestCluster::start(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        3,
        CP_ARGS,
        "segment_bytes: 65536\nhousekeeping_ms: 200\n",
    )
    .unwrap();
    c.admin
        .post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams"),
            &serde_json::json!({"stream": "kept", "kind": "Stream", "shards": 1,
                "replication_factor": 3, "consistency": "Quorum",
                "retention": {"max_size_bytes": 131072}}),
        )
        .unwrap();
    let leader_of = |c: &TestCluster| leader_and_generation(c, "stream", Some("kept"));
    let (leader, generation) =
        wait_for("a leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    let via = (leader + 1) % 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[via].listen, c.client_config().unwrap());
    let want = rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config.clone())
            .await
            .unwrap();
        let mut want = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut k = 0;
        while k < 20 {
            let (key, value) = (format!("k{k}"), format!("v{k}"));
            let put = StateChange::Put {
                key: key.clone(),
                value: value.clone().into(),
            };
            match client
                .commit(
                    TENANT,
                    NAMESPACE,
                    "kept",
                    "acct",
                    "e".into(),
                    vec![put],
                    None,
                )
                .await
            {
                Ok(at) => {
                    want.insert(key, (value.into_bytes(), at));
                    k += 1;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "commits never went through: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        // ~640 KiB after them in 64 KiB segments, kept to 128 KiB.
        for _ in 0..160 {
            client
                .publish(
                    TENANT,
                    NAMESPACE,
                    "kept",
                    vec![b'x'; 4096],
                    AckMode::PerMessage,
                )
                .await
                .unwrap();
        }
        want
    });
    // Every replica trims, the leader having carried the state first.
    wait_retention_everywhere(&c, 5);
    let copies = c.brokers[leader]
        .metric("felix_broker_state_copies_total")
        .unwrap();
    assert!(copies >= 20, "the leader copied the state: {copies}");
    c.brokers[leader].kill();
    wait_for("a new leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
    })
    .unwrap();
    rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        for (key, (value, at)) in &want {
            loop {
                match client
                    .state_get(TENANT, NAMESPACE, "kept", "acct", key)
                    .await
                {
                    Ok((got, _)) => {
                        assert_eq!(
                            got.map(|(v, o)| (v.to_vec(), o)),
                            Some((value.clone(), *at)),
                            "{key}"
                        );
                        break;
                    }
                    Err(e) => {
                        assert!(Instant::now() < deadline, "state reads never resumed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    });
    let _ = &mut c;
}

/// A follower saves the producer table of a stream it copies (read from its last save
/// and the log after it), so the successor of a killed leader builds its table from
/// that save and reads little of its log, and decides re-sends as the whole log would.
#[test]
fn a_successor_builds_its_producer_table_from_its_own_snapshot() {
    let mut c = cluster_with("producer_snapshot_bytes: 65536\nhousekeeping_ms: 50\n");
    c.create_stream("idem-snap", 1, 3, "Quorum").unwrap();
    let leader_of = |c: &TestCluster| leader_and_generation(c, "stream", Some("idem-snap"));
    let (leader, _) = wait_for("a leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    let via = (leader + 1) % 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let connect = |c: &TestCluster, via: usize| {
        let (addr, config) = (c.brokers[via].listen, c.client_config().unwrap());
        async move {
            felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap()
        }
    };
    let body = |producer: u64, seq: u64| {
        let mut v = format!("{producer}-{seq}-").into_bytes();
        v.resize(1000, b'x');
        bytes::Bytes::from(v)
    };
    // Retried through the leader's first generation and the failover.
    let publish = |client: &felix_client::Client, producer: u64, seq: u64, b: bytes::Bytes| {
        let client = client.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let r = client
                    .publish_idempotent(
                        TENANT,
                        NAMESPACE,
                        "idem-snap",
                        None,
                        vec![b.clone()],
                        producer,
                        seq,
                    )
                    .await;
                match r {
                    Ok(o) => return Ok(o),
                    Err(felix_client::ClientError::Refused { reason, .. }) => return Err(reason),
                    Err(e) => {
                        assert!(Instant::now() < deadline, "never went through: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    };
    let mut offsets = BTreeMap::new();
    rt.block_on(async {
        let client = connect(&c, via).await;
        for seq in 0..3 {
            offsets.insert(
                (7, seq),
                publish(&client, 7, seq, body(7, seq)).await.unwrap(),
            );
        }
        for seq in 0..400 {
            offsets.insert(
                (8, seq),
                publish(&client, 8, seq, body(8, seq)).await.unwrap(),
            );
        }
    });
    // The leader now (an election during the publishes may have moved it).
    let (leader, generation) = leader_of(&c).unwrap();
    let followers: Vec<usize> = (0..3).filter(|n| *n != leader).collect();
    let saved = |n: usize| {
        c.brokers[n]
            .metric("felix_broker_producer_snapshots_saved_total")
            .unwrap_or(0)
    };
    // Saves settle once the log stopped growing: each follower's last one is then
    // within a save's worth (64 KB) of the end, and none is running.
    let mut counts = Vec::new();
    let mut stable_since = Instant::now();
    wait_for("each follower's saves", Duration::from_secs(60), || {
        let now: Vec<u64> = followers.iter().map(|n| saved(*n)).collect();
        if now != counts {
            (counts, stable_since) = (now, Instant::now());
        }
        (counts.iter().all(|s| *s >= 1) && stable_since.elapsed() > Duration::from_secs(1))
            .then_some(())
    })
    .unwrap();
    assert_eq!(
        leader_of(&c),
        Some((leader, generation)),
        "the leader stayed while the followers saved"
    );
    let read_before: Vec<u64> = (0..3)
        .map(|n| {
            c.brokers[n]
                .metric("felix_broker_producer_table_read_bytes_total")
                .unwrap_or(0)
        })
        .collect();
    c.brokers[leader].kill();
    let (successor, _) = wait_for("a new leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
    })
    .unwrap();
    rt.block_on(async {
        let client = connect(&c, successor).await;
        // Before the follower's save and after it: each answered from the log.
        assert_eq!(
            publish(&client, 7, 1, body(7, 1)).await.unwrap(),
            offsets[&(7, 1)]
        );
        assert_eq!(
            publish(&client, 8, 399, body(8, 399)).await.unwrap(),
            offsets[&(8, 399)]
        );
        let next = publish(&client, 8, 400, body(8, 400)).await.unwrap();
        assert!(next > offsets[&(8, 399)]);
        assert_eq!(
            publish(&client, 7, 5, body(7, 5)).await,
            Err(felix_wire::message::PublishRefusalReason::SequenceGap {
                expected: felix_wire::Sequence(3)
            })
        );
    });
    let from_snapshot = c.brokers[successor]
        .metric("felix_broker_producer_tables_from_snapshot_total")
        .unwrap();
    let read = c.brokers[successor]
        .metric("felix_broker_producer_table_read_bytes_total")
        .unwrap()
        - read_before[successor];
    eprintln!("the successor built {from_snapshot} table(s) from a snapshot, reading {read} bytes");
    assert!(from_snapshot >= 1);
    assert!(read < 400_000 / 2, "read {read} bytes of a ~400 KB log");
}

#[test]
fn an_idempotent_resend_after_a_leader_kill_is_answered_from_the_successors_log() {
    let mut c = cluster();
    c.create_stream("orders-idem", 1, 3, "Quorum").unwrap();
    let leader_of = |c: &TestCluster| leader_and_generation(c, "stream", Some("orders-idem"));
    let (leader, generation) =
        wait_for("a leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    let via = (leader + 1) % 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let connect = |c: &TestCluster| {
        let (addr, config) = (c.brokers[via].listen, c.client_config().unwrap());
        async move {
            felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap()
        }
    };
    let body = |i: u64| bytes::Bytes::from(format!("order-{i}"));
    let producer = 0xfe11_c0de_u64;
    let mut offsets = BTreeMap::new();
    rt.block_on(async {
        let client = connect(&c).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut i = 0;
        while i < 30 {
            match client
                .publish_idempotent(
                    TENANT,
                    NAMESPACE,
                    "orders-idem",
                    None,
                    vec![body(i)],
                    producer,
                    i,
                )
                .await
            {
                Ok(o) => {
                    offsets.insert(i, o);
                    i += 1;
                }
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "publishes never went through: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    c.brokers[leader].kill();
    wait_for("a new leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
    })
    .unwrap();
    rt.block_on(async {
        let client = connect(&c).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        // The last ten answers were "lost": re-sent to the successor, each is answered
        // with its original offset.
        for i in 20..30u64 {
            loop {
                match client
                    .publish_idempotent(
                        TENANT,
                        NAMESPACE,
                        "orders-idem",
                        None,
                        vec![body(i)],
                        producer,
                        i,
                    )
                    .await
                {
                    Ok(o) => {
                        assert_eq!(o, offsets[&i], "batch {i} answered from the log");
                        break;
                    }
                    Err(e) => {
                        assert!(
                            Instant::now() < deadline,
                            "re-sends never went through: {e}"
                        );
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
        let o = client
            .publish_idempotent(
                TENANT,
                NAMESPACE,
                "orders-idem",
                None,
                vec![body(30)],
                producer,
                30,
            )
            .await
            .unwrap();
        offsets.insert(30, o);
    });
    // And across a planned move: the new leader answers re-sends from its log too.
    let (now_leader, now_generation) = leader_of(&c).unwrap();
    let to = (0..3)
        .find(|n| *n != now_leader && *n != leader)
        .expect("the third broker");
    move_shard(&c, "stream", "orders-idem", to);
    wait_for("the moved leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l == to && *g > now_generation)
    })
    .unwrap();
    rt.block_on(async {
        let client = connect(&c).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        for i in 25..=31u64 {
            loop {
                match client
                    .publish_idempotent(
                        TENANT,
                        NAMESPACE,
                        "orders-idem",
                        None,
                        vec![body(i)],
                        producer,
                        i,
                    )
                    .await
                {
                    Ok(o) => {
                        if let Some(first) = offsets.get(&i) {
                            assert_eq!(o, *first, "batch {i} answered from the log after the move");
                        }
                        offsets.insert(i, o);
                        break;
                    }
                    Err(e) => {
                        assert!(Instant::now() < deadline, "publishes never resumed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    });
    let read = rt.block_on(read_all(&c, "orders-idem", offsets[&31] + 1));
    let bodies: Vec<_> = read.values().cloned().collect();
    let want: Vec<_> = (0..=31).map(|i| body(i).to_vec()).collect();
    assert_eq!(bodies, want, "each batch exactly once, in order");
    let _ = &mut c;
}

#[test]
fn sigterm_hands_a_leaders_shards_to_replicas_before_it_exits() {
    let mut c = cluster();
    c.create_stream("drained", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("drained", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let acked: Acked = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failed = {
        let c = &c;
        std::thread::scope(|s| {
            let (acked2, stop2) = (acked.clone(), stop.clone());
            let view: &TestCluster = c;
            let h = s.spawn(move || {
                tokio::runtime::Runtime::new()
                    .unwrap()
                    .block_on(publish_until(view, "drained", "d", acked2, stop2))
            });
            wait_for("acked writes", Duration::from_secs(30), || {
                (acked.lock().unwrap().len() >= 50).then_some(())
            })
            .unwrap();
            let at_term = acked.lock().unwrap().len();
            let t = Instant::now();
            view.brokers[leader].signal(libc::SIGTERM);
            let (successor, _) = view
                .wait_leader(
                    "drained",
                    0,
                    Some(leader),
                    generation,
                    Duration::from_secs(20),
                )
                .unwrap();
            let handed_over = t.elapsed();
            wait_for(
                "writes acknowledged on the successor",
                Duration::from_secs(30),
                || (acked.lock().unwrap().len() > at_term + 20).then_some(()),
            )
            .unwrap();
            eprintln!(
                "drain: node-{leader} got SIGTERM after {at_term} acks; node-{successor} led {handed_over:?} later; 20 more acks {:?} after the signal",
                t.elapsed()
            );
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            (h.join().unwrap(), handed_over, t)
        })
    };
    let (failed, handed_over, signalled) = failed;
    // The first SIGTERM is the only one: wait for the exit it started.
    let deadline = Instant::now() + Duration::from_secs(20);
    let exited_cleanly = loop {
        if let Some(status) = c.brokers[leader].exit_status() {
            break status.success();
        }
        assert!(Instant::now() < deadline, "the drained broker never exited");
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("drain: exited {:?} after the signal", signalled.elapsed());
    assert!(exited_cleanly, "the drained broker exits 0");
    assert!(
        handed_over < Duration::from_secs(1),
        "leadership moved at the drain, not after a lease expiry ({handed_over:?})"
    );
    eprintln!("publishes that failed or timed out during the drain: {failed}");
    let acked = acked.lock().unwrap().clone();
    let read = rt.block_on(read_all(
        &c,
        "drained",
        acked.keys().next_back().map_or(0, |o| o + 1),
    ));
    check_nothing_lost(&acked, &read);
}

/// Runs the SDK script `name` against `c` (its seeds, a client token, the CA, then
/// `count`) on a thread of its own, while the caller moves shards.
fn sdk_script(
    c: &TestCluster,
    name: &'static str,
    count: &'static str,
) -> std::thread::JoinHandle<anyhow::Result<std::process::Output>> {
    let token = c.dir.path().join("client.token");
    std::fs::write(&token, &c.client_token).unwrap();
    let seeds = c
        .seeds()
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (token, ca) = (
        token.display().to_string(),
        c.certs.ca.display().to_string(),
    );
    std::thread::spawn(move || felix_cluster::run_python_args(name, &[&seeds, &token, &ca, count]))
}

#[test]
fn a_subscriber_follows_its_shard_across_planned_moves() {
    let c = cluster();
    c.create_stream("moving", 1, 3, "Quorum").unwrap();
    let (mut leader, mut generation) = c
        .wait_leader("moving", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let script = sdk_script(&c, "follow_move.py", "300");
    // Three moves while it publishes and reads, each to the next replica.
    let mut cutovers = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        let to = (leader + 1) % 3;
        let t = Instant::now();
        move_shard(&c, "stream", "moving", to);
        (leader, generation) = c
            .wait_leader(
                "moving",
                0,
                Some(leader),
                generation,
                Duration::from_secs(20),
            )
            .unwrap();
        cutovers.push(t.elapsed());
    }
    let out = script.join().unwrap().unwrap();
    let text = felix_cluster::expect_success("follow_move.py", &out).unwrap();
    eprintln!("{text}\nmove to new assignment: {cutovers:?}");
    let moved: u64 = c
        .brokers
        .iter()
        .map(|b| {
            b.metric("felix_broker_subscriptions_moved_total")
                .unwrap_or(0)
        })
        .sum();
    assert!(moved >= 1, "a subscription ended with shard_moved");
}

/// A cache watch follows its cache across planned moves: the watch ended
/// `cache_watch_lagged` when its shard moved, which ends the SDK's watch; it ends with
/// `shard_moved` now, and the standard SDK follows the shard and carries on where it
/// was. So does `felix cache watch` (our SDK's `CacheWatch` ends `Moved`, and the
/// command watches again), watching beside it from the cache's start.
#[test]
fn a_cache_watch_follows_its_shard_across_planned_moves() {
    use std::io::BufRead;
    let c = cluster();
    create_quorum_cache(&c, "moving-cache");
    let (mut leader, mut generation) = wait_for("a cache leader", Duration::from_secs(20), || {
        leader_and_generation(&c, "cache", Some("moving-cache"))
    })
    .unwrap();
    let script = sdk_script(&c, "watch_follow.py", "300");
    let started = c.dir.path().join("watch_follow.started");
    wait_for("the script's watch", Duration::from_secs(60), || {
        started.exists().then_some(())
    })
    .unwrap();
    let mut cli = std::process::Command::new(env!("CARGO_BIN_EXE_felix-under-test"));
    for seed in c.seeds() {
        cli.arg("--broker").arg(seed.to_string());
    }
    let cli = cli
        .args(["--tenant", TENANT, "--namespace", NAMESPACE, "--token-file"])
        .arg(c.dir.path().join("client.token"))
        .arg("--ca")
        .arg(&c.certs.ca)
        .args(["--server-name", "localhost", "--json", "cache", "watch"])
        .args(["moving-cache", "--key", "k", "--from", "0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut cli = Killed(cli);
    // The (offset, value) pairs it printed, as they come.
    let printed = Arc::new(Mutex::new(Vec::<(u64, String)>::new()));
    let reader = {
        let (printed, stdout) = (printed.clone(), cli.0.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
                let value = v["payload"].as_str().unwrap_or("(deleted)").to_owned();
                printed
                    .lock()
                    .unwrap()
                    .push((v["offset"].as_u64().unwrap(), value));
            }
        })
    };
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(2000));
        let to = (leader + 1) % 3;
        move_shard(&c, "cache", "moving-cache", to);
        (leader, generation) = wait_for("the move", Duration::from_secs(20), || {
            leader_and_generation(&c, "cache", Some("moving-cache"))
                .filter(|(l, g)| *l != leader && *g > generation)
        })
        .unwrap();
    }
    let out = script.join().unwrap().unwrap();
    let text = felix_cluster::expect_success("watch_follow.py", &out).unwrap();
    eprintln!("{text}");
    let last = wait_for(
        "the command's watch to see the last put",
        Duration::from_secs(30),
        || {
            (printed.lock().unwrap().iter())
                .any(|(_, v)| v == "v-299")
                .then_some(())
        },
    );
    let _ = cli.0.kill();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut cli.0.stderr.take().unwrap(), &mut stderr).unwrap();
    reader.join().unwrap();
    last.unwrap_or_else(|e| panic!("{e}; the command said: {stderr}"));
    let printed = printed.lock().unwrap();
    // A change shown twice across a move (a resume offset off by one) repeats its
    // offset; a put the script retried comes again at an offset of its own.
    let offsets: Vec<u64> = printed.iter().map(|(o, _)| *o).collect();
    assert!(
        offsets.windows(2).all(|w| w[0] < w[1]),
        "each change once, in log order: {offsets:?}"
    );
    let mut values: Vec<u32> = (printed.iter())
        .filter_map(|(_, v)| v.strip_prefix("v-")?.parse().ok())
        .collect();
    values.dedup();
    assert_eq!(values, (0..300).collect::<Vec<_>>(), "every put, in order");
    assert!(
        stderr.matches("cache shard moved").count() >= 1,
        "it followed the moves: {stderr}"
    );
}

/// A child process killed and reaped however a test ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn twenty_planned_moves_under_load_lose_and_double_nothing() {
    let c = cluster();
    c.create_stream("moves20", 1, 3, "Quorum").unwrap();
    let (mut leader, mut generation) = c
        .wait_leader("moves20", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let log: Published = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Our SDK's sharded subscriber reads from the start through every move: (offset,
    // payload) delivered, and the moves it was told of.
    type Delivered = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;
    let delivered: Delivered = Arc::default();
    let told_moved = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Set once publishing stopped: the last acknowledged offset, + 1.
    let read_until = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut moves = Vec::new();
    let failed = std::thread::scope(|s| {
        let (delivered2, told2, until2, c2) = (
            delivered.clone(),
            told_moved.clone(),
            read_until.clone(),
            &c,
        );
        let subscriber = s.spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move {
                    use felix_client::ShardEvent;
                    let client = Arc::new(
                        felix_client::ClusterClient::connect(
                            &c2.seeds(),
                            "localhost",
                            c2.client_config().unwrap(),
                        )
                        .await
                        .unwrap(),
                    );
                    let mut sub = client
                        .subscribe_sharded(
                            TENANT,
                            NAMESPACE,
                            "moves20",
                            Some(StartPosition::Earliest),
                        )
                        .await
                        .unwrap();
                    let mut finished_at: Option<Instant> = None;
                    loop {
                        let until = until2.load(std::sync::atomic::Ordering::SeqCst);
                        if until > 0 {
                            let f = *finished_at.get_or_insert_with(Instant::now);
                            let last = delivered2.lock().unwrap().last().map(|(o, _)| *o);
                            if last.is_some_and(|o| o + 1 >= until)
                                || f.elapsed() > Duration::from_secs(30)
                            {
                                return;
                            }
                        }
                        match tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
                            Ok(Some(ShardEvent::Record { event, .. })) => delivered2
                                .lock()
                                .unwrap()
                                .push((event.offset.unwrap(), event.payload.to_vec())),
                            Ok(Some(ShardEvent::ShardMoved { .. })) => {
                                told2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            Ok(Some(other)) => eprintln!("subscriber: {other:?}"),
                            Ok(None) => panic!("the sharded subscription ended"),
                            Err(_) => {}
                        }
                    }
                })
        });
        let (log2, stop2, client) = (log.clone(), stop.clone(), client_of(&c));
        let h = s.spawn(move || publish_one_at_a_time(client, "moves20", log2, stop2));
        wait_for("acked writes", Duration::from_secs(30), || {
            (log.lock().unwrap().len() >= 20).then_some(())
        })
        .unwrap();
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(600));
            let to = (leader + 1) % 3;
            move_shard(&c, "stream", "moves20", to);
            moves.push(Instant::now());
            (leader, generation) = c
                .wait_leader(
                    "moves20",
                    0,
                    Some(leader),
                    generation,
                    Duration::from_secs(20),
                )
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(600));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = h.join().unwrap();
        let last = log.lock().unwrap().iter().map(|(_, _, o, _)| *o).max();
        read_until.store(last.unwrap() + 1, std::sync::atomic::Ordering::SeqCst);
        subscriber.join().unwrap();
        failed
    });
    let log = log.lock().unwrap().clone();
    // Cut-over to the first acknowledgement of a publish sent after it.
    let mut gaps: Vec<Duration> = moves
        .iter()
        .map(|m| {
            log.iter()
                .filter(|(sent, _, _, _)| sent > m)
                .map(|(_, acked, _, _)| *acked - *m)
                .min()
                .expect("writes acknowledged after every move")
        })
        .collect();
    gaps.sort();
    eprintln!(
        "20 moves: cut-over to first ack on the new leader median {:?}, max {:?}; {} acked; failed or timed out: {failed:?}; held at takeovers: {}",
        gaps[gaps.len() / 2],
        gaps[gaps.len() - 1],
        log.len(),
        (0..3)
            .map(|n| c.brokers[n]
                .metric("felix_broker_takeover_held_total")
                .unwrap_or(0))
            .sum::<u64>()
    );
    // Writes reaching the new leader while it takes over are held and then appended,
    // and the old leader forwards to it once fenced: refusals are few (88 in 20 moves
    // without the hold, 545 also without the prompt assignment pickup). Writes in flight
    // at the old leader may still end outcome-unknown (`unacknowledged`), as they must.
    // The count varies widely between runs, almost all `not_ready` (21 once in CI with
    // the suite beside it: 15 `not_ready`, 3 `stale`, 3 `not_assigned`); where those
    // come from is not understood yet (see the cache-hold test below), hence the margin.
    let refused: u64 = failed
        .iter()
        .filter(|(e, _)| e.contains("shard unavailable"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        refused <= 40,
        "{refused} publishes refused in 20 moves: {failed:?}"
    );
    let (acked, read) = check_published(&c, "moves20", &log);
    // The subscriber resumed at the right offset after every move: each record once, in
    // offset order, the log's own payload at each offset, every acknowledged one there.
    let delivered = delivered.lock().unwrap().clone();
    let told = told_moved.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!(
        "our SDK's sharded subscriber: {} records, told of {told} moves",
        delivered.len()
    );
    for w in delivered.windows(2) {
        assert!(
            w[0].0 < w[1].0,
            "delivered out of order or twice: {} then {}",
            w[0].0,
            w[1].0
        );
    }
    let got: BTreeMap<u64, Vec<u8>> = delivered.into_iter().collect();
    for (o, p) in &got {
        assert_eq!(read.get(o), Some(p), "offset {o} delivered as in the log");
    }
    for o in acked.keys() {
        assert!(got.contains_key(o), "acknowledged offset {o} delivered");
    }
    // Every move ends the subscription at the old leader with `shard_moved`; one in
    // the middle of following the previous may end it otherwise.
    assert!(told >= 10, "told of {told} of 20 moves");
}

#[test]
fn a_groups_cursor_and_dead_letters_survive_a_leader_kill() {
    use felix_client::{GroupRef, PollOptions};
    let mut c = cluster();
    c.create_stream("jobs", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("jobs", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let g = GroupRef::new(TENANT, NAMESPACE, "jobs", 0, "workers");
    let poll = PollOptions {
        max_records: 100,
        wait: Duration::from_millis(300),
        visibility: Some(Duration::from_secs(60)),
    };
    let at = connector(&c);
    let (handled, dead, rest) = rt.block_on(async {
        let client = at(leader).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut published = Vec::new();
        while published.len() < 30 {
            let body = format!("job-{}", published.len()).into_bytes();
            match client
                .publish(TENANT, NAMESPACE, "jobs", body, AckMode::PerMessage)
                .await
            {
                Ok(o) => published.push(o.expect("an offset")),
                Err(e) => {
                    assert!(Instant::now() < deadline, "the leader never served: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        let got = client
            .group_poll(
                &g,
                PollOptions {
                    max_records: 21,
                    ..poll
                },
            )
            .await
            .unwrap();
        let got: Vec<u64> = got.iter().map(|r| r.offset.0).collect();
        assert_eq!(got, published[..21], "the first 21 records, in order");
        // Acks out of order, one record left unsettled (its claim dies with the leader:
        // it must come back though records after it were acked), then one record given
        // up on.
        let unsettled = got[5];
        let acked: Vec<u64> = got[..20]
            .iter()
            .copied()
            .filter(|o| *o != unsettled)
            .collect();
        for o in acked.iter().rev() {
            client.group_ack(&g, *o).await.unwrap();
        }
        client.group_dead_letter(&g, got[20]).await.unwrap();
        let owed: Vec<u64> = std::iter::once(unsettled)
            .chain(published[21..].iter().copied())
            .collect();
        (acked, got[20], owed)
    });
    c.brokers[leader].kill();
    let (successor, _) = c
        .wait_leader("jobs", 0, Some(leader), generation, Duration::from_secs(30))
        .unwrap();
    rt.block_on(async {
        let client = at(successor).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        loop {
            match client.group_poll(&g, poll).await {
                Ok(records) if records.is_empty() && seen.len() >= rest.len() => break,
                Ok(records) => {
                    for r in records {
                        seen.push(r.offset.0);
                        client.group_ack(&g, r.offset.0).await.unwrap();
                    }
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "the group never came back: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            assert!(Instant::now() < deadline, "only {seen:?} delivered");
        }
        seen.sort();
        // What was acked or dead-lettered on the old leader never comes back; the record
        // left unsettled and those it never handed out come, once each.
        assert!(
            seen.iter().all(|o| !handled.contains(o) && *o != dead),
            "redelivered after the failover: {seen:?}"
        );
        assert_eq!(seen, rest, "after the failover");
        assert_eq!(client.group_dead_letters(&g).await.unwrap(), vec![dead]);
    });
}

/// An idle group outlives retention on a Quorum stream and a leader kill: before the
/// cut passes the newest group snapshot the leader writes one, and every replica keeps
/// the segments from its newest committed snapshot on, so the successor folds its own
/// trimmed log into the group. Without the floor the group's every event (three acks
/// and its creation, in the first of ~12 segments) went with the log's head, and the
/// successor knew no such group.
#[test]
fn an_idle_group_outlives_retention_on_every_replica_and_a_leader_kill() {
    use felix_client::{GroupRef, PollOptions};
    let mut c = cluster_with("segment_bytes: 65536\nhousekeeping_ms: 200\n");
    c.admin
        .post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams"),
            &serde_json::json!({"stream": "idle", "kind": "Stream", "shards": 1,
                "replication_factor": 3, "consistency": "Quorum",
                "retention": {"max_size_bytes": 131072}}),
        )
        .unwrap();
    let (leader, generation) = c
        .wait_leader("idle", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let g = GroupRef::new(TENANT, NAMESPACE, "idle", 0, "workers");
    let at = connector(&c);
    let before = rt.block_on(async {
        let client = at(leader).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut published = 0;
        while published < 3 {
            match client
                .publish(
                    TENANT,
                    NAMESPACE,
                    "idle",
                    b"job".to_vec(),
                    AckMode::PerMessage,
                )
                .await
            {
                Ok(_) => published += 1,
                Err(e) => {
                    assert!(Instant::now() < deadline, "the leader never served: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        let poll = PollOptions {
            max_records: 3,
            wait: Duration::from_millis(300),
            visibility: Some(Duration::from_secs(60)),
        };
        let got = client.group_poll(&g, poll).await.unwrap();
        assert_eq!(got.len(), 3);
        for r in &got {
            client.group_ack(&g, r.offset.0).await.unwrap();
        }
        // ~640 KiB after them in 64 KiB segments, kept to 128 KiB.
        for _ in 0..160 {
            client
                .publish(
                    TENANT,
                    NAMESPACE,
                    "idle",
                    vec![b'x'; 4096],
                    AckMode::PerMessage,
                )
                .await
                .unwrap();
        }
        client.group_describe(&g).await.unwrap()
    });
    assert!(before.committed.is_some(), "{before:?}");
    wait_retention_everywhere(&c, 5);
    c.brokers[leader].kill();
    let (successor, _) = c
        .wait_leader("idle", 0, Some(leader), generation, Duration::from_secs(30))
        .unwrap();
    rt.block_on(async {
        let client = at(successor).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let after = loop {
            match client.group_describe(&g).await {
                Ok(info) => break info,
                Err(e) => {
                    assert!(Instant::now() < deadline, "the group never came back: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        // Its cursor is the successor's oldest retained record.
        assert!(
            after.committed.is_some_and(|c| c > 3),
            "the group on the successor: {after:?}"
        );
    });
}

/// A leadership that serves no group request still snapshots the shard's groups: the
/// successor of a killed leader, taking only publishes, builds the groups it saw shipped
/// and writes a snapshot once a snapshot's worth of log has been written, so the fold of
/// whoever leads next does not read everything written since the old leader's last one.
#[test]
fn a_new_leader_snapshots_its_groups_without_a_group_request() {
    use felix_client::{GroupRef, PollOptions};
    let mut c = cluster_with("group_snapshot_bytes: 65536\n");
    c.create_stream("jobs", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("jobs", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let g = GroupRef::new(TENANT, NAMESPACE, "jobs", 0, "workers");
    let at = connector(&c);
    let publish = async |client: &felix_client::Client, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut done = 0;
        while done < n {
            match client
                .publish(
                    TENANT,
                    NAMESPACE,
                    "jobs",
                    vec![b'j'; 1000],
                    AckMode::PerMessage,
                )
                .await
            {
                Ok(_) => done += 1,
                Err(e) => {
                    assert!(Instant::now() < deadline, "the leader never served: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    rt.block_on(async {
        let client = at(leader).await;
        publish(&client, 10).await;
        let poll = PollOptions {
            max_records: 5,
            wait: Duration::from_millis(300),
            visibility: Some(Duration::from_secs(60)),
        };
        for r in client.group_poll(&g, poll).await.unwrap() {
            client.group_ack(&g, r.offset.0).await.unwrap();
        }
    });
    c.brokers[leader].kill();
    let (successor, _) = c
        .wait_leader("jobs", 0, Some(leader), generation, Duration::from_secs(30))
        .unwrap();
    let snapshots = |i: usize| {
        c.brokers[i]
            .metric("felix_broker_group_snapshots_total")
            .unwrap()
    };
    assert_eq!(snapshots(successor), 0, "it never led the shard before");
    rt.block_on(async {
        let client = at(successor).await;
        publish(&client, 200).await;
    });
    felix_cluster::wait_for(
        "a group snapshot on the successor, which served no group request",
        Duration::from_secs(15),
        || (snapshots(successor) > 0).then_some(()),
    )
    .unwrap();
    assert_eq!(
        c.brokers[successor]
            .metric("felix_broker_group_folds_total")
            .unwrap(),
        1,
        "its groups were built once, for the snapshot"
    );
    // The next leader folds from that snapshot (the old leader wrote none: its group
    // requests wrote far less than a snapshot's worth), and the groups are the ones the
    // first leader left: the 5 acked records do not come back, the other 205 do.
    c.brokers[leader].restart().unwrap();
    let (_, successors_generation) = c
        .wait_leader("jobs", 0, Some(leader), generation, Duration::from_secs(5))
        .unwrap();
    rt.block_on(async {
        // The restarted broker catches up before the successor goes.
        let client = at(successor).await;
        publish(&client, 1).await;
    });
    std::thread::sleep(Duration::from_secs(1));
    c.brokers[successor].kill();
    let (third, _) = c
        .wait_leader(
            "jobs",
            0,
            Some(successor),
            successors_generation,
            Duration::from_secs(30),
        )
        .unwrap();
    rt.block_on(async {
        let client = at(third).await;
        let poll = PollOptions {
            max_records: 100,
            wait: Duration::from_millis(300),
            visibility: Some(Duration::from_secs(60)),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = 0;
        loop {
            match client.group_poll(&g, poll).await {
                Ok(got) if got.is_empty() => break,
                Ok(got) => seen += got.len(),
                Err(e) => {
                    assert!(Instant::now() < deadline, "the group never came back: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        assert_eq!(seen, 206);
    });
    assert_eq!(
        c.brokers[third]
            .metric("felix_broker_group_folds_from_snapshot_total")
            .unwrap(),
        1,
        "the third leader folded from the successor's snapshot"
    );
}

/// `publish_if` on a replicated Quorum shard: through any broker (a follower forwards
/// it), of racers at one tail exactly one batch lands; it survives a leader kill at its
/// offset, and the new leader's tail (past its generation-start record) is what a
/// stale writer is told.
#[test]
fn a_conditional_publish_on_a_quorum_stream_lands_once_through_any_broker() {
    use felix_wire::message::PublishRefusalReason;
    let mut c = cluster();
    c.create_stream("ledger", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("ledger", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let at = connector(&c);
    let refused_tail = |r: Result<u64, felix_client::ClientError>| match r {
        Err(felix_client::ClientError::Refused {
            reason: PublishRefusalReason::OffsetMismatch { tail },
            ..
        }) => Some(tail.0),
        _ => None,
    };
    let batch = |tag: String| {
        vec![
            bytes::Bytes::from(format!("{tag}-0")),
            bytes::Bytes::from(format!("{tag}-1")),
        ]
    };
    let (landed, tail) = rt.block_on(async {
        let clients = [at(0).await, at(1).await, at(2).await];
        // Learn the tail the way a writer does: a refusal names it (the leader's
        // generation start holds an offset).
        let deadline = Instant::now() + Duration::from_secs(20);
        let tail = loop {
            match refused_tail(
                clients[leader]
                    .publish_if(
                        TENANT,
                        NAMESPACE,
                        "ledger",
                        None,
                        batch("probe".into()),
                        u64::MAX,
                    )
                    .await,
            ) {
                Some(t) => break t,
                None => {
                    assert!(Instant::now() < deadline, "the leader never served");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        assert!(tail >= 1, "the generation start holds offset 0");
        // Nine racers, three through each broker, at that tail.
        let racers = (0..9).map(|i| {
            let client = clients[i % 3].clone();
            tokio::spawn(async move {
                let outcome = client
                    .publish_if(
                        TENANT,
                        NAMESPACE,
                        "ledger",
                        None,
                        batch(format!("r{i}")),
                        tail,
                    )
                    .await;
                (i, outcome)
            })
        });
        let mut won = Vec::new();
        for r in racers.collect::<Vec<_>>() {
            let (i, outcome) = r.await.unwrap();
            match outcome {
                Ok(offset) => won.push((i, offset)),
                other => assert_eq!(refused_tail(other), Some(tail + 2), "racer {i}"),
            }
        }
        assert_eq!(won.len(), 1, "exactly one racer lands: {won:?}");
        assert_eq!(won[0].1, tail);
        (won[0].0, tail)
    });
    c.brokers[leader].kill();
    let (successor, _) = c
        .wait_leader(
            "ledger",
            0,
            Some(leader),
            generation,
            Duration::from_secs(30),
        )
        .unwrap();
    rt.block_on(async {
        let client = at(successor).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        // The old tail is stale now: the new leader's generation start came after it.
        let new_tail = loop {
            match refused_tail(
                client
                    .publish_if(
                        TENANT,
                        NAMESPACE,
                        "ledger",
                        None,
                        batch("late".into()),
                        tail + 2,
                    )
                    .await,
            ) {
                Some(t) => break t,
                None => {
                    assert!(Instant::now() < deadline, "the successor never served");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        assert!(
            new_tail > tail + 2,
            "{new_tail}: the successor's generation start"
        );
        assert_eq!(
            client
                .publish_if(
                    TENANT,
                    NAMESPACE,
                    "ledger",
                    None,
                    batch("after".into()),
                    new_tail
                )
                .await
                .unwrap(),
            new_tail
        );
        let (records, _) = client
            .stream_read(TENANT, NAMESPACE, "ledger", 0, 0, None, Some(100))
            .await
            .unwrap();
        let got: Vec<(u64, String)> = records
            .iter()
            .map(|r| (r.offset.0, String::from_utf8_lossy(&r.payload).into_owned()))
            .collect();
        assert_eq!(
            got,
            vec![
                (tail, format!("r{landed}-0")),
                (tail + 1, format!("r{landed}-1")),
                (new_tail, "after-0".to_string()),
                (new_tail + 1, "after-1".to_string()),
            ]
        );
    });
}

/// Connects a client to broker `i` of `c` (addresses and credentials copied out, so
/// the cluster stays free to kill and restart its brokers, which keep their address).
fn connector(
    c: &TestCluster,
) -> impl Fn(usize) -> std::pin::Pin<Box<dyn std::future::Future<Output = felix_client::Client>>> + use<>
{
    let addrs: Vec<_> = c.brokers.iter().map(|b| b.listen).collect();
    let config = c.client_config().unwrap();
    move |i| {
        let (addr, config) = (addrs[i], config.clone());
        Box::pin(async move {
            felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap()
        })
    }
}

fn dir_bytes(p: &Path) -> u64 {
    let mut total = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                total += dir_bytes(&e.path());
            } else {
                total += e.metadata().map_or(0, |m| m.len());
            }
        }
    }
    total
}

/// A replicated cache overwritten thousands of times stays small on every replica (each
/// removes its own segments below a compaction's cut once the cut marker commits), and
/// the replica promoted after a leader kill rebuilds every value, version and counter
/// from its compacted log.
#[test]
fn a_replicated_cache_is_compacted_on_every_replica_and_keeps_its_values_across_a_leader_kill() {
    use felix_wire::message::CacheCondition;
    let mut c = TestCluster::start(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        3,
        CP_ARGS,
        "segment_bytes: 65536\ncache_compact_after: 500\nhousekeeping_ms: 200\n",
    )
    .unwrap();
    create_quorum_cache(&c, "hot");
    let leader_of = |c: &TestCluster| leader_and_generation(c, "cache", None);
    let (leader, generation) =
        wait_for("a cache leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    let via = (leader + 1) % 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    const WRITERS: usize = 4;
    const EACH: usize = 1500;
    let (addr, config) = (c.brokers[via].listen, c.client_config().unwrap());
    let (pinned_version, last) = rt.block_on(async {
        let client = felix_client::Client::connect(addr, "localhost", config.clone())
            .await
            .unwrap();
        // The new shard serves once its leader has fenced a majority.
        let deadline = Instant::now() + Duration::from_secs(30);
        let pinned = loop {
            match client
                .cache_put_if(
                    TENANT,
                    NAMESPACE,
                    "hot",
                    "pinned",
                    "written once".into(),
                    None,
                    CacheCondition::Absent,
                )
                .await
            {
                Ok((_, v)) => break v,
                Err(e) => {
                    assert!(Instant::now() < deadline, "cache writes never began: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let config = config.clone();
                tokio::spawn(async move {
                    let c = felix_client::Client::connect(addr, "localhost", config)
                        .await
                        .unwrap();
                    for i in 0..EACH {
                        let v = format!("{w}-{i}-{}", "x".repeat(300));
                        c.cache_put(TENANT, NAMESPACE, "hot", &format!("key{w}"), v.into(), None)
                            .await
                            .unwrap();
                        c.counter_add(TENANT, NAMESPACE, "hot", "writes", 1)
                            .await
                            .unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.await.unwrap();
        }
        let last = client
            .cache_get(TENANT, NAMESPACE, "hot", "key0")
            .await
            .unwrap();
        (pinned.expect("a version"), last)
    });
    let written = WRITERS * EACH * 330;
    // Every replica cuts its own log once the marker commits (housekeeping, 200 ms).
    let bound = 700 * 1024;
    let sizes = wait_for(
        "every replica's cache log compacted",
        Duration::from_secs(20),
        || {
            let sizes: Vec<u64> = c
                .brokers
                .iter()
                .map(|b| dir_bytes(&b.data_dir.join("caches")))
                .collect();
            sizes.iter().all(|s| *s < bound).then_some(sizes)
        },
    )
    .unwrap_or_else(|e| {
        let sizes: Vec<u64> = c
            .brokers
            .iter()
            .map(|b| dir_bytes(&b.data_dir.join("caches")))
            .collect();
        panic!("{e}: cache log bytes per broker {sizes:?} (bound {bound}, ~{written} written)")
    });
    let compactions = c.brokers[leader]
        .metric("felix_broker_cache_compactions_total")
        .unwrap();
    eprintln!(
        "{} puts and as many adds (~{written} bytes): {compactions} compactions on the leader; cache log bytes per broker {sizes:?}",
        WRITERS * EACH
    );
    assert!(compactions > 0);
    c.brokers[leader].kill();
    wait_for("a new cache leader", Duration::from_secs(30), || {
        leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
    })
    .unwrap();
    let config = c.client_config().unwrap();
    rt.block_on(async move {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match client.cache_get(TENANT, NAMESPACE, "hot", "key0").await {
                Ok(v) => {
                    assert_eq!(v, last, "the last value survives compaction and the kill");
                    break;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "cache reads never resumed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        assert_eq!(
            client
                .cache_get(TENANT, NAMESPACE, "hot", "pinned")
                .await
                .unwrap()
                .as_deref(),
            Some(&b"written once"[..]),
            "a value written once before every compaction is still there"
        );
        let (applied, version) = client
            .cache_put_if(
                TENANT,
                NAMESPACE,
                "hot",
                "pinned",
                "again".into(),
                None,
                CacheCondition::Absent,
            )
            .await
            .unwrap();
        assert!(!applied);
        assert_eq!(
            version,
            Some(pinned_version),
            "with the version it was written at"
        );
        assert_eq!(
            client
                .counter_get(TENANT, NAMESPACE, "hot", "writes")
                .await
                .unwrap(),
            Some((WRITERS * EACH) as i64),
            "the counter is exact"
        );
    });
    let _ = &mut c;
}

/// Cache writes, like publishes, are held while the new leader of a planned move takes
/// the cache over (and forwarded there by the old one), instead of refused: three
/// writers (one per broker, so most adds are forwarded) add 1 to one counter, one at a
/// time, through 20 moves of the RF 3 Quorum cache. Every acknowledged sum is distinct
/// and the final counter is the acknowledged adds plus at most the outcome-unknown ones.
#[test]
fn cache_writes_are_held_through_planned_moves() {
    let c = cluster();
    create_quorum_cache(&c, "moving");
    let leader_of = |c: &TestCluster| leader_and_generation(c, "cache", Some("moving"));
    let (mut leader, mut generation) =
        wait_for("a cache leader", Duration::from_secs(20), || leader_of(&c)).unwrap();
    #[derive(Default, Debug)]
    struct Outcomes {
        sums: Vec<i64>,
        refused: u64,
        unknown: u64,
    }
    let outcomes: Arc<Mutex<Outcomes>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::thread::scope(|s| {
        let mut writers = Vec::new();
        for b in 0..3 {
            let (outcomes, stop, addr, config) = (
                outcomes.clone(),
                stop.clone(),
                c.brokers[b].listen,
                c.client_config().unwrap(),
            );
            writers.push(s.spawn(move || {
                tokio::runtime::Runtime::new()
                    .unwrap()
                    .block_on(async move {
                        let client = felix_client::Client::connect(addr, "localhost", config)
                            .await
                            .unwrap();
                        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                            let add = client.counter_add(TENANT, NAMESPACE, "moving", "n", 1);
                            let r = tokio::time::timeout(Duration::from_secs(3), add).await;
                            let mut o = outcomes.lock().unwrap();
                            match r {
                                Ok(Ok(sum)) => o.sums.push(sum),
                                Ok(Err(felix_client::ClientError::Broker(e)))
                                    if e.code == Some(felix_wire::ErrorCode::ShardUnavailable) =>
                                {
                                    o.refused += 1;
                                }
                                _ => o.unknown += 1,
                            }
                        }
                    })
            }));
        }
        wait_for("acknowledged adds", Duration::from_secs(30), || {
            (outcomes.lock().unwrap().sums.len() >= 20).then_some(())
        })
        .unwrap();
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(400));
            let to = (leader + 1) % 3;
            move_shard(&c, "cache", "moving", to);
            (leader, generation) =
                wait_for("the moved cache leader", Duration::from_secs(20), || {
                    leader_of(&c).filter(|(l, g)| *l != leader && *g > generation)
                })
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(400));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for w in writers {
            w.join().unwrap();
        }
    });
    let o = std::mem::take(&mut *outcomes.lock().unwrap());
    let held: u64 = (0..3)
        .map(|n| {
            c.brokers[n]
                .metric("felix_broker_takeover_held_total")
                .unwrap_or(0)
        })
        .sum();
    eprintln!(
        "20 cache moves: {} adds acknowledged, {} refused, {} outcome unknown; held at takeovers: {held}",
        o.sums.len(),
        o.refused,
        o.unknown
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = c.brokers[0].listen;
    let config = c.client_config().unwrap();
    let total = rt.block_on(async move {
        let client = felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match client.counter_get(TENANT, NAMESPACE, "moving", "n").await {
                Ok(v) => return v.unwrap_or(0),
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "the counter is never readable: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    let mut sums = o.sums.clone();
    sums.sort_unstable();
    sums.dedup();
    assert_eq!(
        sums.len(),
        o.sums.len(),
        "every acknowledged sum is distinct"
    );
    let acked = o.sums.len() as i64;
    assert!(
        total >= acked && total <= acked + o.unknown as i64,
        "counter {total}: {acked} acknowledged, {} unknown",
        o.unknown
    );
    assert!(held > 0, "cache writes were held at a takeover");
    // Measured: 2-17 refused with the hold at an earlier stop, 14-16 alone and 61 once
    // with the rest of the suite beside it in CI (2026-12-01); 135 and 754 with the
    // hold removed.
    assert!(
        o.refused <= 100,
        "{} cache writes refused in 20 moves",
        o.refused
    );
}

/// The reason a shard-unavailable refusal gives, or the error itself.
fn refusal_reason(r: Result<Option<u64>, felix_client::ClientError>) -> Result<String, String> {
    match r {
        Err(felix_client::ClientError::Broker(e))
            if e.code == Some(felix_wire::ErrorCode::ShardUnavailable) =>
        {
            Ok(e.detail
                .and_then(|d| d.reason)
                .unwrap_or_else(|| "(none)".into()))
        }
        other => Err(format!("{other:?}")),
    }
}

/// A new replicated stream's leader can be asked before its core has attached the
/// shard's replica: clients learn the leader from the control plane, the core opens the
/// replica on its next look at the assignments. Writes in that window are held like a
/// takeover's, not refused `not_ready` (a new cache's first writes were, up to 21 in one
/// run of the test above). The window is widened here by pausing every core's look at
/// the assignments (a fault-injection seam): a write waits the whole hold and is refused
/// `moving`, and one waiting when the look resumes is acknowledged.
#[test]
fn a_new_shards_first_writes_wait_for_its_replica_instead_of_being_refused() {
    let c = cluster_with("fault_injection: true\n");
    let pause = |on: bool| {
        for b in &c.brokers {
            let (status, _) = b
                .http_post(&format!("/debug/replica-sync?pause={on}"))
                .unwrap();
            assert_eq!(status, 200);
        }
    };
    pause(true);
    c.create_stream("late", 1, 3, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("late", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, config) = (c.brokers[leader].listen, c.client_config().unwrap());
    let client = rt.block_on(async {
        felix_client::Client::connect(addr, "localhost", config)
            .await
            .unwrap()
    });
    let publish = |client: &felix_client::Client, what: &'static str| {
        let client = client.clone();
        async move {
            let publish = client.publish(
                TENANT,
                NAMESPACE,
                "late",
                what.as_bytes().to_vec(),
                AckMode::PerMessage,
            );
            tokio::time::timeout(Duration::from_secs(5), publish)
                .await
                .expect("a publish is answered within 5 s")
        }
    };
    // Until the leader has read the assignment naming it, it refuses `not_assigned`;
    // then the write is held (no replica to take it), for the whole hold.
    let mut reasons = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let held_for = loop {
        let asked = Instant::now();
        let reason = refusal_reason(rt.block_on(publish(&client, "first")))
            .expect("refused shard_unavailable while no replica is attached");
        assert_ne!(
            reason, "not_ready",
            "refused while the replica was not attached, after {reasons:?}"
        );
        if reason == "moving" {
            break asked.elapsed();
        }
        reasons.push(reason);
        assert!(Instant::now() < deadline, "never held: {reasons:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        held_for >= Duration::from_millis(900),
        "refused `moving` after {held_for:?}, not after holding the write"
    );
    // A write held when the cores look again is taken once the replica serves.
    let second = rt.spawn(publish(&client, "second"));
    std::thread::sleep(Duration::from_millis(100));
    pause(false);
    let second = rt.block_on(second).unwrap();
    let offset = match second {
        Ok(Some(offset)) => offset,
        // On a slow machine the replica's takeover may outlast the hold: once more.
        other => {
            assert_eq!(refusal_reason(other).as_deref(), Ok("moving"));
            rt.block_on(publish(&client, "second")).unwrap().unwrap()
        }
    };
    let read = rt.block_on(read_all(&c, "late", 1));
    assert_eq!(read.get(&offset).map(Vec::as_slice), Some(&b"second"[..]));
    assert!(
        !read.values().any(|v| v == b"first"),
        "a write refused `moving` is not in the log"
    );
}

/// Idempotent publishes, too, are held while a moved shard's new leader takes over
/// (they used to be refused there, and the SDK retried): our SDK's idempotent producer
/// publishes one batch at a time through 10 planned moves of an RF 3 Quorum stream.
/// Every acknowledged batch is in the log at its offset, and no batch is there twice.
#[test]
fn idempotent_publishes_are_held_through_planned_moves() {
    let c = cluster();
    c.create_stream("idem", 1, 3, "Quorum").unwrap();
    let (mut leader, mut generation) = c
        .wait_leader("idem", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let held_before: u64 = (0..3)
        .map(|n| {
            c.brokers[n]
                .metric("felix_broker_takeover_held_total")
                .unwrap_or(0)
        })
        .sum();
    let acked: Arc<Mutex<BTreeMap<u64, Vec<u8>>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::thread::scope(|s| {
        let (acked2, stop2, c2) = (acked.clone(), stop.clone(), &c);
        let h = s.spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move {
                    let client = felix_client::ClusterClient::connect(
                        &c2.seeds(),
                        "localhost",
                        c2.client_config().unwrap(),
                    )
                    .await
                    .unwrap();
                    let producer = client.idempotent_producer().await.unwrap();
                    let mut i = 0u64;
                    while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                        let payload = format!("idem-{i}").into_bytes();
                        // The producer re-sends a batch whose outcome is unknown until it
                        // lands (it must: the next batch is refused until then).
                        loop {
                            match producer
                                .publish(TENANT, NAMESPACE, "idem", payload.clone())
                                .await
                            {
                                Ok(o) => {
                                    acked2.lock().unwrap().insert(o, payload.clone());
                                    break;
                                }
                                Err(e) => {
                                    eprintln!("idempotent publish {i}: {e}; sending it again");
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                            }
                        }
                        i += 1;
                    }
                })
        });
        wait_for("acknowledged batches", Duration::from_secs(30), || {
            (acked.lock().unwrap().len() >= 20).then_some(())
        })
        .unwrap();
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(400));
            let to = (leader + 1) % 3;
            move_shard(&c, "stream", "idem", to);
            (leader, generation) = c
                .wait_leader("idem", 0, Some(leader), generation, Duration::from_secs(20))
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(400));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        h.join().unwrap();
    });
    let acked = acked.lock().unwrap().clone();
    let held: u64 = (0..3)
        .map(|n| {
            c.brokers[n]
                .metric("felix_broker_takeover_held_total")
                .unwrap_or(0)
        })
        .sum::<u64>()
        - held_before;
    eprintln!(
        "10 moves: {} idempotent batches acknowledged; held at takeovers: {held}",
        acked.len()
    );
    check_read_back(&c, "idem", &acked, "batch");
    assert!(held > 0, "idempotent publishes were held at a takeover");
}

#[test]
fn a_move_to_a_broker_outside_the_set_stages_a_copy_and_loses_nothing() {
    let c = cluster();
    // Two copies on three brokers: one broker holds nothing of it.
    c.create_stream("staged", 1, 2, "Quorum").unwrap();
    let (_, mut generation) = c
        .wait_leader("staged", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    // A shard with one copy has nothing shipping its log: refused, typed.
    c.create_stream("single", 1, 1, "Leader").unwrap();
    let (only, _) = c
        .wait_leader("single", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let refused = c
        .admin
        .post(
            "/v1/shard-moves",
            &serde_json::json!({"tenant_id": TENANT, "namespace": NAMESPACE,
                "stream": "single", "shard": 0, "destination": format!("node-{}", (only + 1) % 3)}),
        )
        .unwrap_err();
    assert!(
        refused.to_string().contains("destination_not_replica"),
        "{refused}"
    );
    let log: Published = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let members = |a: &serde_json::Value| members_of(&c, a);
    let mut took = Vec::new();
    let failed = std::thread::scope(|s| {
        let (log2, stop2, client) = (log.clone(), stop.clone(), client_of(&c));
        let h = s.spawn(move || publish_one_at_a_time(client, "staged", log2, stop2));
        wait_for("acked writes", Duration::from_secs(30), || {
            (log.lock().unwrap().len() >= 50).then_some(())
        })
        .unwrap();
        // Four moves, each to the broker that holds no copy (the last move's old
        // leader, after the first).
        for _ in 0..4 {
            let a = c.assignment("staged", 0).unwrap();
            let set = members(&a);
            let to = (0..3).find(|n| !set.contains(n)).unwrap();
            let from = c.index(a["leader"].as_str().unwrap());
            let t = Instant::now();
            move_shard(&c, "stream", "staged", to);
            let done = wait_for("the staged move to finish", Duration::from_secs(30), || {
                let a = c.assignment("staged", 0)?;
                let settled = c.index(a["leader"].as_str()?) == to
                    && a.get("staging").is_none()
                    && a.get("retiring").is_none();
                settled.then_some(a)
            })
            .unwrap();
            took.push(t.elapsed());
            let set = members(&done);
            assert!(set.contains(&to) && !set.contains(&from), "{done}");
            assert_eq!(set.len(), 2, "the set keeps its size: {done}");
            // Staging (same generation: no member changes), cut-over and retirement.
            let g = done["generation"].as_u64().unwrap();
            assert_eq!(g, generation + 2, "{done}");
            generation = g;
            std::thread::sleep(Duration::from_millis(300));
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        h.join().unwrap()
    });
    let log = log.lock().unwrap().clone();
    eprintln!(
        "4 staged moves: request to settled {took:?}; {} acked; failed or timed out: {failed:?}",
        log.len()
    );
    check_published(&c, "staged", &log);
    let refused: u64 = failed
        .iter()
        .filter(|(e, _)| e.contains("shard unavailable"))
        .map(|(_, n)| n)
        .sum();
    // Each move is three new generations, two of them led by the broker that led the
    // one before: writes are held while it takes the shard over again (8-21 refused
    // `stale` per run when they were not; 0-1 with the hold on a quiet machine, 6 in
    // one CI run beside the suite).
    assert!(
        refused <= 7,
        "{refused} publishes refused in 4 moves: {failed:?}"
    );
}

#[test]
fn a_follower_down_too_long_is_replaced_through_a_staged_copy_and_nothing_is_lost() {
    let mut args = CP_ARGS.to_vec();
    args.extend(["--replica-restore-after-ms", "1000"]);
    let mut c = TestCluster::start(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        3,
        &args,
        "",
    )
    .unwrap();
    c.create_stream("restored", 1, 2, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("restored", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let a = c.assignment("restored", 0).unwrap();
    let follower = a["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| c.index(r.as_str().unwrap()))
        .find(|m| *m != leader)
        .unwrap();
    let spare = (0..3).find(|n| *n != leader && *n != follower).unwrap();
    let log: Published = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let publisher = {
        let (log, stop, client) = (log.clone(), stop.clone(), client_of(&c));
        std::thread::spawn(move || publish_one_at_a_time(client, "restored", log, stop))
    };
    wait_for("acked writes", Duration::from_secs(30), || {
        (log.lock().unwrap().len() >= 50).then_some(())
    })
    .unwrap();
    let killed = Instant::now();
    c.brokers[follower].kill();
    // Down past expiry + margin + restore_after: a copy is staged on the spare, joins,
    // and the dead member is retired.
    let done = wait_for("the set restored", Duration::from_secs(40), || {
        let a = c.assignment("restored", 0)?;
        let mut set: Vec<usize> = a["replicas"]
            .as_array()?
            .iter()
            .map(|r| c.index(r.as_str().unwrap()))
            .collect();
        set.sort_unstable();
        let mut want = vec![leader, spare];
        want.sort_unstable();
        (set == want && a.get("staging").is_none() && a.get("retiring").is_none()).then_some(a)
    })
    .unwrap();
    let restored_after = killed.elapsed();
    let acked_then = log.lock().unwrap().len();
    wait_for(
        "writes acknowledged by the restored set",
        Duration::from_secs(20),
        || (log.lock().unwrap().len() >= acked_then + 50).then_some(()),
    )
    .unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let failed = publisher.join().unwrap();
    eprintln!(
        "follower killed; set restored after {restored_after:?}: {done}; {} acked; failed: {failed:?}",
        log.lock().unwrap().len()
    );
    assert_eq!(c.index(done["leader"].as_str().unwrap()), leader);
    // Stage (same generation), join, retire.
    assert_eq!(
        done["generation"].as_u64().unwrap(),
        generation + 2,
        "{done}"
    );
    let log = log.lock().unwrap().clone();
    let acked: BTreeMap<u64, Vec<u8>> = log.iter().map(|(_, _, o, p)| (*o, p.clone())).collect();
    assert_eq!(acked.len(), log.len(), "no offset acknowledged twice");
    let read = rt.block_on(read_all(
        &c,
        "restored",
        acked.keys().next_back().unwrap() + 1,
    ));
    check_nothing_lost(&acked, &read);
    // The replaced follower comes back: its copy, left out of the set while it was
    // down, is removed (no replica opens it), and nothing else of the stream changes.
    let copy = copy_of(&c, follower, "restored");
    assert!(copy.join("replica").exists(), "the killed follower's copy");
    c.brokers[follower].restart().unwrap();
    wait_copy_removed(&c, follower, &copy, Duration::from_secs(30));
    let read = rt.block_on(read_all(
        &c,
        "restored",
        acked.keys().next_back().unwrap() + 1,
    ));
    check_nothing_lost(&acked, &read);
}

/// `felix group` commands work against any broker of a cluster: a group's requests go
/// to the shard's owner, which a `not_leader` answer names (they failed "owned by ..."
/// on any other broker).
#[test]
fn felix_group_commands_reach_the_shards_owner_from_any_broker() {
    let c = TestCluster::start(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        Path::new(env!("CARGO_BIN_EXE_felix-controlplane-under-test")),
        2,
        CP_ARGS,
        "",
    )
    .unwrap();
    c.create_stream("jobs", 1, 1, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("jobs", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let other = 1 - leader;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(publish_n(&c, "jobs", "job", 3));
    let token = c.path().join("client.token");
    std::fs::write(&token, &c.client_token).unwrap();
    let felix = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_felix-under-test"))
            .arg("--broker")
            .arg(c.brokers[other].listen.to_string())
            .args(["--tenant", TENANT, "--namespace", NAMESPACE, "--token-file"])
            .arg(&token)
            .arg("--ca")
            .arg(&c.certs.ca)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "felix {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let polled = felix(&[
        "group", "poll", "jobs", "g", "--max", "10", "--wait", "1", "--ack",
    ]);
    assert_eq!(polled.lines().count(), 3, "{polled}");
    let described = felix(&["group", "describe", "jobs", "g"]);
    // Every record acked (the group's own events and the generation start sit in the
    // log too: the tail counts them).
    assert!(described.contains("\nlag 0\nin_flight 0\n"), "{described}");
}

/// Publishes `n` records one at a time (each retried until acknowledged); answers
/// offset -> payload.
async fn publish_n(c: &TestCluster, stream: &str, tag: &str, n: usize) -> BTreeMap<u64, Vec<u8>> {
    let client =
        felix_client::ClusterClient::connect(&c.seeds(), "localhost", c.client_config().unwrap())
            .await
            .unwrap();
    let mut acked = BTreeMap::new();
    for i in 0..n {
        let payload = format!("{tag}-{i}").into_bytes();
        // A stream just created (again) may be unknown to a busy broker for longer than
        // the client's retries: `not_found` (retry after) means nothing was written. So
        // does `shard_unavailable`: a leader just elected, or resumed from a pause,
        // refuses ("stale") until it holds a valid lease again.
        let deadline = Instant::now() + Duration::from_secs(15);
        let o = loop {
            let published = client
                .publish_at_least_once(
                    TENANT,
                    NAMESPACE,
                    stream,
                    payload.clone(),
                    AckMode::PerMessage,
                )
                .await;
            match published {
                Err(felix_client::ClientError::GaveUp { last, .. })
                    if Instant::now() < deadline
                        && matches!(&*last, felix_client::ClientError::Broker(b)
                            if matches!(b.code, Some(felix_wire::ErrorCode::NotFound
                                | felix_wire::ErrorCode::ShardUnavailable))) =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => break other.unwrap().unwrap(),
            }
        };
        assert!(
            acked.insert(o, payload).is_none(),
            "offset {o} acknowledged twice"
        );
    }
    acked
}

#[test]
fn a_deleted_replicated_stream_leaves_every_broker_and_its_name_comes_back_empty() {
    let mut c = cluster();
    c.create_stream("doomed", 1, 3, "Quorum").unwrap();
    c.wait_leader("doomed", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let old = rt.block_on(publish_n(&c, "doomed", "old", 50));
    let dirs: Vec<_> = c
        .brokers
        .iter()
        .map(|b| {
            b.data_dir
                .join(format!("streams/{TENANT}/{NAMESPACE}/doomed"))
        })
        .collect();
    wait_for("a copy on every broker", Duration::from_secs(10), || {
        dirs.iter().all(|d| d.join("0").exists()).then_some(())
    })
    .unwrap();
    let streams = format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams");
    c.admin.delete(&format!("{streams}/doomed")).unwrap();
    wait_for(
        "the deleted stream's data to leave every broker",
        Duration::from_secs(30),
        || dirs.iter().all(|d| !d.exists()).then_some(()),
    )
    .unwrap();
    // The name comes back with nothing of the old stream in it, on every broker: its
    // leader writes from the start and its followers hold what it ships.
    wait_for("the name to be free again", Duration::from_secs(10), || {
        c.create_stream("doomed", 1, 3, "Quorum").ok()
    })
    .unwrap();
    c.wait_leader("doomed", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let new = rt.block_on(publish_n(&c, "doomed", "new", 20));
    // Offsets from the start again (after its leader's generation start; an election
    // more than the old stream had shifts them by one), not after the old end.
    let (first_old, first_new) = (*old.keys().next().unwrap(), *new.keys().next().unwrap());
    assert!(
        first_new <= first_old + 2,
        "the re-created stream starts at {first_new}, not near {first_old} (old end {:?})",
        old.keys().next_back()
    );
    let read = rt.block_on(read_all(&c, "doomed", 20));
    assert_eq!(
        read, new,
        "the re-created stream holds exactly its own records"
    );
    // Every broker serves it after its leader goes: kill the leader and read again.
    let (leader, g) = c
        .wait_leader("doomed", 0, None, 0, Duration::from_secs(5))
        .unwrap();
    c.brokers[leader].kill();
    c.wait_leader("doomed", 0, Some(leader), g, Duration::from_secs(20))
        .unwrap();
    let read = rt.block_on(read_all(&c, "doomed", 20));
    assert_eq!(read, new, "its new leader holds exactly the new records");
}

/// Broker `b`'s copy of shard 0 of `stream`.
fn copy_of(c: &TestCluster, b: usize, stream: &str) -> std::path::PathBuf {
    c.brokers[b]
        .data_dir
        .join(format!("streams/{TENANT}/{NAMESPACE}/{stream}/0"))
}

/// Waits for broker `b` to remove `copy`, the only copy it removed since it started.
fn wait_copy_removed(c: &TestCluster, b: usize, copy: &Path, within: Duration) {
    wait_for("a left copy to be removed", within, || {
        (!copy.exists()).then_some(())
    })
    .unwrap();
    assert_eq!(
        c.brokers[b]
            .metric("felix_broker_replicas_left_total")
            .unwrap(),
        1
    );
}

/// Members of an assignment, by broker index, sorted.
fn members_of(c: &TestCluster, a: &serde_json::Value) -> Vec<usize> {
    let mut m: Vec<usize> = a["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| c.index(r.as_str().unwrap()))
        .collect();
    m.sort_unstable();
    m
}

/// Moves shard 0 of `stream` to the broker outside its set and waits for the move to
/// settle; answers (from, to).
fn move_to_the_broker_outside(c: &TestCluster, stream: &str) -> (usize, usize) {
    let a = c.assignment(stream, 0).unwrap();
    let set = members_of(c, &a);
    let to = (0..3).find(|n| !set.contains(n)).unwrap();
    let from = c.index(a["leader"].as_str().unwrap());
    move_shard(c, "stream", stream, to);
    wait_for("the staged move to finish", Duration::from_secs(30), || {
        let a = c.assignment(stream, 0)?;
        (c.index(a["leader"].as_str()?) == to
            && a.get("staging").is_none()
            && a.get("retiring").is_none())
        .then_some(())
    })
    .unwrap();
    (from, to)
}

#[test]
fn a_broker_that_left_a_shards_set_removes_its_copy_and_can_be_staged_again_from_nothing() {
    let c = cluster();
    c.create_stream("moving", 1, 2, "Quorum").unwrap();
    c.wait_leader("moving", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut acked = rt.block_on(publish_n(&c, "moving", "a", 100));
    let (from, _) = move_to_the_broker_outside(&c, "moving");
    let copy = copy_of(&c, from, "moving");
    assert!(copy.exists(), "kept through the grace period");
    wait_copy_removed(&c, from, &copy, Duration::from_secs(20));
    // Back to the broker that removed its copy: it is staged from nothing, leads, and
    // holds everything acknowledged before and after.
    acked.extend(rt.block_on(publish_n(&c, "moving", "b", 50)));
    // The broker outside the set is `from` now.
    let (_, to) = move_to_the_broker_outside(&c, "moving");
    assert_eq!(to, from);
    acked.extend(rt.block_on(publish_n(&c, "moving", "c", 50)));
    let read = rt.block_on(read_all(
        &c,
        "moving",
        acked.keys().next_back().unwrap() + 1,
    ));
    check_nothing_lost(&acked, &read);
    // And nothing else but generation starts. The publishes are at-least-once (a write
    // in flight at a move's generation change ends outcome-unknown and is sent again),
    // so a record may be there twice, but every record is one that was published.
    let published: std::collections::BTreeSet<&Vec<u8>> = acked.values().collect();
    let foreign: Vec<_> = read
        .iter()
        .filter(|(_, p)| !published.contains(p))
        .map(|(o, _)| *o)
        .collect();
    assert!(
        foreign.is_empty(),
        "records nobody published at {foreign:?}"
    );
}

/// A leader whose disk is full refuses writes (`overloaded` / `disk_full`, retryable)
/// and takes them again once space is back, on both consistencies. The log gives the
/// refused batches' offsets back; before, the replica kept believing its log ended
/// past them, so every later write on that shard failed `internal` ("the log and the
/// replica disagree on the end") until leadership changed (found by the chaos scenario
/// `filesystem-full-replicated`: 861 such failures in one 60 s run).
#[test]
fn a_leader_whose_disk_filled_up_takes_writes_again_once_space_is_back() {
    let c = cluster_with("fault_injection: true\n");
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (stream, consistency) in [("full-q", "Quorum"), ("full-l", "Leader")] {
        c.create_stream(stream, 1, 3, consistency).unwrap();
        let (leader, _) = c
            .wait_leader(stream, 0, None, 0, Duration::from_secs(20))
            .unwrap();
        let mut acked = rt.block_on(publish_n(&c, stream, "before", 20));
        storage_fault(&c, leader, "op=write&errno=enospc&times=always");
        let (addr, config) = (c.brokers[leader].listen, c.client_config().unwrap());
        rt.block_on(async {
            let client = felix_client::Client::connect(addr, "localhost", config)
                .await
                .unwrap();
            for i in 0..3 {
                let e = client
                    .publish(
                        TENANT,
                        NAMESPACE,
                        stream,
                        format!("refused-{i}").into_bytes(),
                        AckMode::PerMessage,
                    )
                    .await
                    .expect_err("the leader's disk is full");
                assert!(e.to_string().contains("disk_full"), "{stream}: {e}");
            }
        });
        storage_fault(&c, leader, "clear=true");
        acked.extend(rt.block_on(publish_n(&c, stream, "after", 20)));
        assert_eq!(
            c.wait_leader(stream, 0, None, 0, Duration::from_secs(1))
                .unwrap()
                .0,
            leader,
            "{stream}: the same leader took the writes again"
        );
        // Every acknowledged record reads back, the old ones included.
        check_nothing_lost(&acked, &rt.block_on(read_all(&c, stream, 40)));
        let offsets: Vec<u64> = acked.keys().copied().collect();
        assert_eq!(offsets.len(), 40, "{stream}");
        assert_eq!(
            offsets.windows(2).filter(|w| w[1] != w[0] + 1).count(),
            0,
            "{stream}: the refused writes' offsets were taken again: {offsets:?}"
        );
    }
}

/// A broker made leader while its disk is full cannot write its generation-start record
/// (the log gives the offset back); once space is back it writes it and serves. Before,
/// its machine took the record as claimed and waited for it to become durable forever:
/// the shard stayed `not_ready` until the next assignment (found in review).
#[test]
fn a_leader_elected_while_its_disk_is_full_serves_once_space_is_back() {
    let c = cluster_with("fault_injection: true\n");
    c.create_stream("elect", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("elect", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut acked = rt.block_on(publish_n(&c, "elect", "before", 10));
    let to = (leader + 1) % 3;
    storage_fault(&c, to, "op=write&errno=enospc&times=always");
    move_shard(&c, "stream", "elect", to);
    let (now, _) = c
        .wait_leader("elect", 0, None, generation, Duration::from_secs(20))
        .unwrap();
    assert_eq!(now, to, "the control plane made the full broker leader");
    std::thread::sleep(Duration::from_millis(1500));
    storage_fault(&c, to, "clear=true");
    acked.extend(rt.block_on(publish_n(&c, "elect", "after", 10)));
    assert_eq!(
        c.wait_leader("elect", 0, None, 0, Duration::from_secs(1))
            .unwrap()
            .0,
        to,
        "the broker made leader while full is the one serving"
    );
    let offsets: Vec<u64> = acked.keys().copied().collect();
    assert_eq!(offsets.len(), 20);
    // The new leader holds what the old one acknowledged.
    check_nothing_lost(&acked, &rt.block_on(read_all(&c, "elect", 20)));
}

/// A broker down while its stream was deleted and created again under the same name
/// comes back holding the old incarnation's copy. It must drop it, not serve it as the
/// new one's: before, made leader of the new stream, it served the deleted records (the
/// chaos scenario `delete-recreate`: "incarnation 1 … holds 7 records of earlier ones").
/// The control plane now gives each stream an incarnation id; a broker that holds the
/// name under another one deletes its data first. And the stream is created again before
/// the live brokers removed their copies of the deleted one: those copies, answering the
/// new leader's fence (both at generation 1) with the old log, made it take the deleted
/// records; replication messages now name the incarnation they are about.
#[test]
fn a_broker_away_while_its_stream_was_deleted_and_created_again_drops_the_old_data() {
    let mut c = cluster();
    c.create_stream("again", 1, 3, "Quorum").unwrap();
    let (leader, _) = c
        .wait_leader("again", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(publish_n(&c, "again", "old", 30));
    let away = (leader + 1) % 3;
    wait_for(
        "a copy on the broker to go away",
        Duration::from_secs(10),
        || copy_of(&c, away, "again").exists().then_some(()),
    )
    .unwrap();
    c.brokers[away].kill();
    let streams = format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams");
    c.admin.delete(&format!("{streams}/again")).unwrap();
    // Created again at once: the live brokers' copies of the deleted stream may still be
    // there (a core removes them at its next housekeeping round), and must not answer for
    // the new one.
    wait_for("the name to be free again", Duration::from_secs(30), || {
        c.create_stream("again", 1, 3, "Quorum").ok()
    })
    .unwrap();
    c.wait_leader("again", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let new = rt.block_on(publish_n(&c, "again", "new", 10));
    c.brokers[away].restart().unwrap();
    // The broker that was away leads the new stream and is read from.
    let (now, generation) = c
        .wait_leader("again", 0, None, 0, Duration::from_secs(5))
        .unwrap();
    if now != away {
        move_shard(&c, "stream", "again", away);
        let (moved, _) = c
            .wait_leader("again", 0, None, generation, Duration::from_secs(30))
            .unwrap();
        assert_eq!(moved, away);
    }
    let read = rt.block_on(read_all(&c, "again", new.len() as u64));
    assert_eq!(
        read, new,
        "the broker that was away serves exactly the new incarnation's records"
    );
}

/// Writes `rot` until its copy on `follower` holds sealed segments (about 1 KiB a
/// record, 64 KiB segments), then kills that broker and flips a byte in the middle of
/// its oldest sealed segment. Returns the records acknowledged, the segment's name and
/// its damaged bytes.
fn damage_a_copy(
    c: &mut TestCluster,
    rt: &tokio::runtime::Runtime,
    b: usize,
) -> (BTreeMap<u64, Vec<u8>>, std::ffi::OsString, Vec<u8>) {
    let pad = "r".repeat(1000);
    let acked = rt.block_on(publish_n(c, "rot", &pad, 250));
    let copy = copy_of(c, b, "rot");
    let sealed = wait_for(
        "the copy to hold sealed segments",
        Duration::from_secs(10),
        || {
            let mut segments: Vec<_> = std::fs::read_dir(&copy)
                .ok()?
                .filter_map(|e| {
                    let p = e.ok()?.path();
                    (p.extension()? == "seg").then_some(p)
                })
                .collect();
            segments.sort();
            (segments.len() >= 3).then(|| segments[0].clone())
        },
    )
    .unwrap();
    c.brokers[b].kill();
    let mut bytes = std::fs::read(&sealed).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&sealed, &bytes).unwrap();
    (acked, sealed.file_name().unwrap().to_owned(), bytes)
}

/// Waits for broker `b` to set its damaged copy of `rot` aside under
/// `damaged-copies/`, where the damaged segment `name` is kept unchanged (`bytes`).
fn wait_set_aside(c: &TestCluster, b: usize, name: &std::ffi::OsStr, bytes: &[u8]) {
    let root = c.brokers[b].data_dir.join("damaged-copies");
    let in_place = copy_of(c, b, "rot").join(name);
    let kept = wait_for(
        "the damaged copy set aside",
        Duration::from_secs(20),
        || {
            // The empty copy is built under `damaged-copies/` (its first segment has the
            // damaged one's name when that was the first) and exchanged with the shard's
            // directory: the entry there is the damaged copy only once the shard's
            // directory no longer holds the damaged bytes. (Reading it before the
            // exchange failed this test once in CI.)
            if std::fs::read(&in_place).is_ok_and(|b| b == bytes) {
                return None;
            }
            std::fs::read_dir(&root)
                .ok()?
                .filter_map(|e| std::fs::read(e.ok()?.path().join(name)).ok())
                .next()
        },
    )
    .unwrap();
    let first_diff = kept.iter().zip(bytes).position(|(a, b)| a != b);
    assert!(
        kept == bytes,
        "the damaged segment was kept as it was: {} bytes kept, {} written, first difference at {first_diff:?}",
        kept.len(),
        bytes.len()
    );
    // ... and counted where an operator looks.
    let b = &c.brokers[b];
    let counted = wait_for("the damaged copy counted", Duration::from_secs(10), || {
        let copies = b.metric("felix_broker_damaged_copies").ok()?;
        let held = b.metric("felix_broker_damaged_copies_bytes").ok()?;
        (copies == 1 && held >= bytes.len() as u64).then_some(())
    });
    assert!(
        counted.is_ok(),
        "felix_broker_damaged_copies {:?}, _bytes {:?} (the segment alone is {})",
        b.metric("felix_broker_damaged_copies").ok(),
        b.metric("felix_broker_damaged_copies_bytes").ok(),
        bytes.len()
    );
}

/// Three brokers with 64 KiB segments and a Quorum stream `rot` of three copies:
/// the cluster, its leader and generation, and a runtime for the client.
fn rot_cluster() -> (TestCluster, usize, u64, tokio::runtime::Runtime) {
    let c = cluster_with("segment_bytes: 65536\n");
    c.create_stream("rot", 1, 3, "Quorum").unwrap();
    let (leader, generation) = c
        .wait_leader("rot", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    (
        c,
        leader,
        generation,
        tokio::runtime::Runtime::new().unwrap(),
    )
}

/// Waits for broker `b` to hold its copy of `rot` open and whole again (not rebuilding).
fn wait_rebuilt(c: &TestCluster, b: usize) {
    wait_for("the copy rebuilt", Duration::from_secs(20), || {
        let b = &c.brokers[b];
        (b.metric("felix_broker_shards_open").ok()? == 1
            && b.metric("felix_broker_replicas_rebuilding").ok()? == 0)
            .then_some(())
    })
    .unwrap();
}

/// Row 7 of the fault matrix in a cluster: a follower's copy found damaged inside a
/// sealed segment when it restarts is set aside (kept for an operator, never cut to
/// what still reads) and rebuilt empty from the others. Until it holds what it may
/// have acknowledged it counts in no election; the control plane starts a new
/// generation under the same leader, which the rebuilt copy verifies, and from then
/// on it counts again: with the leader killed, it and the intact follower elect a
/// leader that serves every acknowledged record and takes more.
#[test]
fn a_follower_whose_copy_is_damaged_sets_it_aside_and_rebuilds_it_from_the_others() {
    let (mut c, leader, generation, rt) = rot_cluster();
    let follower = (leader + 1) % 3;
    let (mut acked, name, bytes) = damage_a_copy(&mut c, &rt, follower);
    c.brokers[follower].restart().unwrap();
    wait_set_aside(&c, follower, &name, &bytes);
    // The intact copies are a majority: Quorum writes go on.
    acked.extend(rt.block_on(publish_n(&c, "rot", "after", 20)));
    // The leader learned the follower rebuilds (its fence was answered so), and the
    // control plane renewed the generation under the same leader.
    let (same, renewed) = c
        .wait_leader("rot", 0, None, generation, Duration::from_secs(20))
        .unwrap();
    assert_eq!(same, leader, "a renewal, not a failover");
    wait_rebuilt(&c, follower);
    acked.extend(rt.block_on(publish_n(&c, "rot", "rebuilt", 20)));
    // It counts again: without the leader, it and the intact follower elect one.
    c.brokers[leader].kill();
    let (successor, _) = c
        .wait_leader("rot", 0, Some(leader), renewed, Duration::from_secs(30))
        .unwrap();
    acked.extend(rt.block_on(publish_n(&c, "rot", "failed over", 20)));
    assert_ne!(successor, leader);
    // And it serves them itself: led from the rebuilt copy, every record acknowledged
    // since the start reads back (a copy rebuilt without the old records, say from the
    // leader's end on, would have nothing below that to serve).
    let now = c
        .wait_leader("rot", 0, None, renewed, Duration::from_secs(1))
        .unwrap()
        .1;
    if successor != follower {
        move_shard(&c, "stream", "rot", follower);
        let (moved, _) = c
            .wait_leader("rot", 0, None, now, Duration::from_secs(30))
            .unwrap();
        assert_eq!(moved, follower);
    }
    check_nothing_lost(
        &acked,
        &rt.block_on(read_all(&c, "rot", acked.len() as u64)),
    );
}

/// The same for the leader's copy: restarted within its lease, the broker named leader
/// finds its copy damaged, sets it aside and reports it cannot lead this generation;
/// the control plane promotes another member at once (no lease to wait out), which
/// serves every acknowledged record, and the old leader rebuilds its copy as a
/// follower.
#[test]
fn a_leader_whose_copy_is_damaged_hands_over_and_rebuilds_it_from_the_others() {
    let (mut c, leader, generation, rt) = rot_cluster();
    let (mut acked, name, bytes) = damage_a_copy(&mut c, &rt, leader);
    c.brokers[leader].restart().unwrap();
    wait_set_aside(&c, leader, &name, &bytes);
    let (_, promoted) = c
        .wait_leader("rot", 0, Some(leader), generation, Duration::from_secs(30))
        .unwrap();
    acked.extend(rt.block_on(publish_n(&c, "rot", "after", 20)));
    check_nothing_lost(
        &acked,
        &rt.block_on(read_all(&c, "rot", acked.len() as u64)),
    );
    // The old leader's copy is rebuilt at the generation elected without it.
    wait_rebuilt(&c, leader);
    acked.extend(rt.block_on(publish_n(&c, "rot", "rebuilt", 20)));
    // It counts again: without the new leader, it and the third member elect one.
    let (successor, now) = c
        .wait_leader("rot", 0, None, promoted - 1, Duration::from_secs(1))
        .unwrap();
    assert_eq!(
        now, promoted,
        "no renewal: it lost its copy at an older generation than the new one"
    );
    c.brokers[successor].kill();
    c.wait_leader("rot", 0, Some(successor), now, Duration::from_secs(30))
        .unwrap();
    acked.extend(rt.block_on(publish_n(&c, "rot", "failed over", 20)));
    check_nothing_lost(
        &acked,
        &rt.block_on(read_all(&c, "rot", acked.len() as u64)),
    );
}

/// The `epochs` file: a replica that opens its log after retention removed the record
/// that began the generation in force at its base learns that generation from the file
/// (the records left carry no label of their own, and a leader's next message would
/// teach it only once it hears one). An election compares logs by the generation of
/// their last record, then their end: a copy that took its records for generation 0
/// loses to a shorter one, and records only it and the dead leader held (acknowledged)
/// are cut. Here one follower is paused while the leader and the other commit 20
/// records; the leader and that other follower are killed, the paused one resumed, the
/// other restarted: without hearing from any leader it must know its records'
/// generation to win. (The simulator models the file; this is its process-level check.)
#[test]
fn a_copy_reopened_after_retention_removed_its_generations_start_still_wins_with_the_records_it_holds()
 {
    let mut c = cluster_with("segment_bytes: 65536\nhousekeeping_ms: 200\n");
    c.admin
        .post(
            &format!("/v1/tenants/{TENANT}/namespaces/{NAMESPACE}/streams"),
            &serde_json::json!({"stream": "aged", "kind": "Stream", "shards": 1,
                "replication_factor": 3, "consistency": "Quorum",
                "retention": {"max_size_bytes": 131072}}),
        )
        .unwrap();
    let (leader, generation) = c
        .wait_leader("aged", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // ~640 KiB of 4 KiB records in 64 KiB segments, kept to 128 KiB: the segment
    // holding the generation's start record goes on every replica.
    let big = "x".repeat(4000);
    let mut acked = rt.block_on(publish_n(&c, "aged", &big, 160));
    wait_retention_everywhere(&c, 5);
    let (holder, paused) = ((leader + 1) % 3, (leader + 2) % 3);
    c.brokers[paused].signal(libc::SIGSTOP);
    let only_two = rt.block_on(publish_n(&c, "aged", "leader-and-holder", 20));
    acked.extend(only_two.clone());
    c.brokers[leader].kill();
    c.brokers[holder].kill();
    c.brokers[paused].signal(libc::SIGCONT);
    c.brokers[holder].restart().unwrap();
    let (successor, _) = c
        .wait_leader("aged", 0, Some(leader), generation, Duration::from_secs(30))
        .unwrap();
    assert_ne!(successor, leader);
    acked.extend(rt.block_on(publish_n(&c, "aged", "failed-over", 20)));
    let read = rt.block_on(read_all(&c, "aged", acked.len() as u64));
    let base = *read.keys().next().expect("records read back");
    assert!(
        base > 0,
        "retention removed the oldest records (base {base})"
    );
    let kept: BTreeMap<u64, Vec<u8>> = acked.into_iter().filter(|(o, _)| *o >= base).collect();
    assert!(
        only_two.keys().all(|o| kept.contains_key(o)),
        "the records only two copies held are above the base"
    );
    check_nothing_lost(&kept, &read);
    let _ = &mut c;
}

/// An idempotent producer's re-send of a batch the leader acknowledged is answered
/// from the producer table, without a write; past the lease that answer is an
/// acknowledgement like any other and must not be given: it would confirm on a
/// `Leader` stream a record a successor may not hold. The broker is cut from the
/// control plane, so it still believes it leads when the re-send comes (a paused one
/// would read its demotion within milliseconds of waking). The session's check of
/// the lease as an ack goes out refuses it (outcome unknown); without that check the
/// table's answer went out.
#[test]
fn a_leader_past_its_lease_does_not_answer_a_duplicate() {
    use felix_cluster::proxy::{Link, Party};
    use felix_wire::{Features, Message, ProducerId, RequestId, Sequence};
    let c = one_broker_with_a_short_lease();
    c.create_stream("dup", 1, 1, "Leader").unwrap();
    c.wait_leader("dup", 0, None, 0, Duration::from_secs(20))
        .unwrap();
    let (lo, hi) = Features::ERROR_CODES
        .union(Features::IDEMPOTENT_PRODUCER)
        .offer();
    let auth = Message::Auth {
        tenant_id: TENANT.into(),
        token: c.client_token.clone(),
        client_flags: Some(0x1FFF),
        client_features: lo,
        client_features_hi: hi,
    }
    .to_frame();
    let batch = |producer: u64, seq: u64| {
        Message::PublishIdempotent {
            tenant_id: TENANT.into(),
            namespace: NAMESPACE.into(),
            stream: "dup".into(),
            payloads: vec![bytes::Bytes::from(format!("{producer}-{seq}"))],
            key: None,
            shard: None,
            request_id: RequestId(1),
            producer_id: ProducerId(producer),
            sequence: Sequence(seq),
        }
        .to_frame()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (_ep, conn) = rt
        .block_on(felix_cluster::raw_connect_to(
            c.brokers[0].listen,
            &c.certs.ca,
        ))
        .unwrap();
    // The answer to `frame`, sent on a stream of its own after `auth`.
    let ask = |frame: bytes::Bytes| {
        rt.block_on(async {
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            s.write_all(&auth).await.unwrap();
            s.write_all(&frame).await.unwrap();
            s.finish().unwrap();
            let answers = tokio::time::timeout(
                Duration::from_secs(10),
                felix_cluster::read_messages(&mut r, 2),
            )
            .await
            .expect("an answer")
            .unwrap();
            answers.get(1).cloned().flatten()
        })
    };
    let acked = |m: &Option<Message>| matches!(m, Some(Message::PublishOk { .. }));
    let stale = |m: &Option<Message>| matches!(m, Some(Message::PublishError { message, .. }) if message.contains("stale"));
    let first = wait_for(
        "the first batch acknowledged",
        Duration::from_secs(20),
        || {
            let answer = ask(batch(7, 0));
            acked(&answer).then_some(answer)
        },
    )
    .unwrap();
    let rules = c.net.as_ref().expect("proxies").rules.clone();
    rules.set_both(Party::Node(0), Party::ControlPlane, Link::cut());
    let mut seq = 0;
    wait_for("the lease to lapse", Duration::from_secs(15), || {
        seq += 1;
        // A new producer each time: a refused batch is not a sequence's next.
        let answer = ask(batch(100 + seq, 0));
        let refused = stale(&answer);
        if !refused {
            std::thread::sleep(Duration::from_millis(20));
        }
        refused.then_some(())
    })
    .unwrap();
    let again = ask(batch(7, 0));
    rules.heal();
    assert!(
        matches!(&again, Some(Message::PublishError { message, .. })
            if message.contains("stale") || message.contains("lease lapsed")),
        "a re-send of {first:?} answered past the lease: {again:?}"
    );
}

/// The replication port closes a connection none of whose streams says a good `Hello`
/// within 10 s, and one whose streams send more than 1 MiB before any `Hello`, with
/// error 1; a peer that said one stays connected past the deadline. Anyone reaching
/// the port, no token needed, held up to 64 KiB on each of a connection's streams there
/// for as long as it kept the connection alive.
#[test]
fn the_replication_port_closes_connections_that_say_no_hello() {
    use felix_wire::internal::{Hello, InternalMessage};
    let c = cluster();
    let token = c
        .admin
        .post(
            "/v1/tenants/operator/tokens",
            &serde_json::json!({"sub": "node-z", "audience": "felix-controlplane",
                                "perms": ["node.manage:node:node-z"]}),
        )
        .unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut hello = bytes::BytesMut::new();
    InternalMessage::Hello(Hello {
        correlation_id: 0,
        node_id: "node-z".into(),
        token,
        capabilities: 0,
    })
    .encode(&mut hello)
    .unwrap();
    let yaml = std::fs::read_to_string(c.dir.path().join("node-0.yaml")).unwrap();
    let internal: std::net::SocketAddr = yaml
        .lines()
        .find_map(|l| l.strip_prefix("internal_listen: "))
        .expect("an internal listener")
        .trim()
        .parse()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let pem = std::fs::read_to_string(&c.certs.ca).unwrap();
        let roots = felix_core_runtime::quic::certs_from_pem(&pem).unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(
            felix_core_runtime::quic::internal_client_config(&roots, Default::default()).unwrap(),
        );
        let closed_with_1 = |conn: &quinn::Connection| match conn.close_reason() {
            None => false,
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                assert_eq!(u64::from(c.error_code), 1, "{c:?}");
                true
            }
            Some(other) => panic!("closed otherwise: {other:?}"),
        };
        // A frame begun and never finished: a header announcing 65,000 bytes, 60,000
        // of them sent.
        let mut begun = felix_wire::internal::InternalHeader {
            kind: felix_wire::internal::kind::HELLO,
            length: 65_000,
        }
        .to_bytes()
        .to_vec();
        begun.resize(12 + 60_000, 7);
        let started = Instant::now();
        // A peer: its Hello, then nothing (keep-alives hold the connection).
        let good = ep.connect(internal, "localhost").unwrap().await.unwrap();
        let mut s = good.open_uni().await.unwrap();
        s.write_all(&hello).await.unwrap();
        let idle = ep.connect(internal, "localhost").unwrap().await.unwrap();
        let mut s = idle.open_uni().await.unwrap();
        s.write_all(&begun[..100]).await.unwrap();
        let flood = ep.connect(internal, "localhost").unwrap().await.unwrap();
        let mut streams = Vec::new();
        for _ in 0..40 {
            let Ok(mut s) = flood.open_uni().await else {
                break;
            };
            if s.write_all(&begun).await.is_err() {
                break;
            }
            streams.push(s);
        }
        tokio::time::timeout(Duration::from_secs(5), async {
            while !closed_with_1(&flood) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("2.4 MB before any hello closes the connection");
        tokio::time::timeout(Duration::from_secs(20), async {
            while !closed_with_1(&idle) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("a connection that says no hello is closed");
        assert!(
            started.elapsed() >= Duration::from_secs(9),
            "closed at the deadline, not before: {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            good.close_reason().is_none(),
            "a peer that said hello is closed: {:?}",
            good.close_reason()
        );
        drop(s);
    });
}
