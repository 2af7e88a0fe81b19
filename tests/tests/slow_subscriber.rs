//! A subscriber that never reads does not slow the others or grow the broker's memory
//! without bound: its queue overflows (DropNew) while a healthy subscriber gets every
//! record. A slow one that reads again gets every record too, read back from the log,
//! and one reading a long backlog more slowly than the broker sends it is not cut off.
//!
//! `cargo test` publishes 6,000 records of 4 KiB (24 MiB); the long form sets
//! `FELIX_SLOW_SUBSCRIBER_RECORDS=262144` (1 GiB; docs/reliability.md has its figures).

use std::sync::Arc;
use std::time::Duration;

use felix_cluster::{
    BrokerProcess, expect_success, raw_auth, raw_connect, raw_publish, read_messages, run_python,
};
use felix_wire::{FrameReader, Message};

/// Records of 4 KiB each test publishes.
fn records() -> usize {
    std::env::var("FELIX_SLOW_SUBSCRIBER_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6000)
}

/// `felix-broker dev` on a data directory of its own; bind as `(_dir, broker)` so the
/// broker stops before its directory goes.
fn dev_broker() -> (tempfile::TempDir, BrokerProcess) {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    let (broker, dir) = BrokerProcess::start_dev_in_temp_dir(bin, &[]).unwrap();
    (dir, broker)
}

/// A raw QUIC client that subscribes and then never reads its event stream.
async fn stalled_subscriber(
    broker: &BrokerProcess,
) -> (quinn::Endpoint, quinn::Connection, quinn::RecvStream) {
    let pem = std::fs::read_to_string(broker.ca_file()).unwrap();
    let roots = felix_core_runtime::quic::certs_from_pem(&pem).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(
        felix_core_runtime::quic::client_config(&roots, false, Default::default()).unwrap(),
    );
    let conn = ep
        .connect(broker.listen, "localhost")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let auth = Message::Auth {
        tenant_id: "dev".into(),
        token: broker.token(),
        client_flags: Some(0x1FFF),
        client_features: Some(0x800),
        client_features_hi: None,
    };
    send.write_all(&auth.to_frame()).await.unwrap();
    let sub = Message::Subscribe {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        stream: "fan".into(),
        subscription_id: None,
        start: None,
        shard: None,
        queue_capacity: None,
    };
    send.write_all(&sub.to_frame()).await.unwrap();
    let mut reader = FrameReader::new(1 << 20);
    let mut answers = Vec::new();
    while answers.len() < 2 {
        let chunk = recv.read_chunk(1 << 16, true).await.unwrap().unwrap();
        reader.push(chunk.bytes);
        while let Some(f) = reader.next_frame().unwrap() {
            answers.push(Message::decode(&f.payload).unwrap());
        }
    }
    assert!(matches!(answers[0], Message::AuthOk { .. }), "{answers:?}");
    assert!(
        matches!(answers[1], Message::Subscribed { .. }),
        "{answers:?}"
    );
    // Accept the event stream and never read it.
    let events = conn.accept_uni().await.unwrap();
    (ep, conn, events)
}

#[test]
fn a_subscriber_that_never_reads_is_isolated() {
    let (_dir, broker) = dev_broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let held = Arc::new(rt.block_on(stalled_subscriber(&broker)));
    let rss_before = broker.rss_kib();
    // 6,000 records of 4 KiB (24 MiB) overflow the stalled subscriber's flow-control
    // window and its broker-side queue.
    let n = records().to_string();
    let out = run_python(&broker, "fanout.py", &[&n]).unwrap();
    let text = expect_success("fanout.py", &out).unwrap();
    eprintln!("{text}");
    std::thread::sleep(Duration::from_millis(200));
    let dropped = broker.metric("felix_broker_events_dropped_total").unwrap();
    let rss_after = broker.rss_kib();
    eprintln!(
        "dropped {dropped} batches for the stalled subscriber; rss {rss_before} -> {rss_after} KiB"
    );
    assert!(
        dropped > 0,
        "the stalled subscriber's queue overflowed and dropped"
    );
    assert!(
        rss_after < rss_before + 128 * 1024,
        "memory stays bounded: {rss_before} -> {rss_after} KiB"
    );
    drop(held);
}

/// Reads every event batch from `events` until `n` records arrived; returns their offsets.
async fn read_offsets(events: &mut quinn::RecvStream, n: usize) -> Vec<u64> {
    let mut reader = FrameReader::new(16 << 20);
    let mut offsets = Vec::new();
    while offsets.len() < n {
        let chunk = tokio::time::timeout(Duration::from_secs(10), events.read_chunk(1 << 20, true))
            .await
            .expect("events keep coming")
            .unwrap()
            .expect("the event stream stays open");
        reader.push(chunk.bytes);
        while let Some(f) = reader.next_frame().unwrap() {
            if f.kind != felix_wire::flags::FrameKind::EventBatch {
                continue; // the hello
            }
            let b = felix_wire::EventBatch::decode(f.flags, &f.payload).unwrap();
            let base = b.base_offset.expect("offsets negotiated").0;
            offsets.extend((0..b.events.len() as u64).map(|i| base + i));
        }
    }
    offsets
}

#[test]
fn a_slow_subscriber_catches_up_from_the_log_without_loss() {
    let (_dir, broker) = dev_broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Subscribed from the tail, then not reading while 6,000 x 4 KiB are published:
    // its queue overflows. When it reads again it must still get every record.
    let (_ep, _conn, mut events) = rt.block_on(stalled_subscriber(&broker));
    let n = records();
    let rss_before = broker.rss_kib();
    let out = run_python(&broker, "fanout.py", &[&n.to_string()]).unwrap();
    expect_success("fanout.py", &out).unwrap();
    assert!(
        broker.metric("felix_broker_events_dropped_total").unwrap() > 0,
        "the queue overflowed"
    );
    let rss_behind = broker.rss_kib();
    let started = std::time::Instant::now();
    let offsets = rt.block_on(read_offsets(&mut events, n));
    eprintln!(
        "caught up {n} records ({} MiB) in {:?}; rss {rss_before} -> {rss_behind} (behind) -> {} KiB (caught up)",
        n * 4 / 1024,
        started.elapsed(),
        broker.rss_kib()
    );
    assert_eq!(offsets.len(), n, "every record, none twice");
    assert_eq!(
        offsets,
        (offsets[0]..offsets[0] + n as u64).collect::<Vec<_>>(),
        "contiguous, in order"
    );
    assert!(
        broker.rss_kib() < rss_before + 128 * 1024,
        "memory stays bounded while it catches up: {rss_before} -> {} KiB",
        broker.rss_kib()
    );
    assert!(
        broker
            .metric("felix_broker_subscriber_catchups_total")
            .unwrap()
            > 0,
        "the gap was read back from the log"
    );
}

/// A subscription from the start of a log of 200,000 small records, read by our SDK more
/// slowly than the broker sends it: every record arrives, on one connection. The broker
/// used to stop reading its socket part-way through such a replay (its readiness probe
/// stayed pending with the reader's acks waiting), so its own idle timer closed the
/// connection and the reader was reset (here after 192,639 records; in the chaos
/// read-backs after ~155,000, on every retry: every run longer than two minutes failed
/// that way). `FELIX_LONG_REPLAY_RECORDS` sets the count.
#[test]
fn a_long_replay_to_a_slower_reader_is_not_cut_off() {
    const PUBLISHERS: u64 = 64;
    let n: u64 = std::env::var("FELIX_LONG_REPLAY_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000)
        / PUBLISHERS
        * PUBLISHERS;
    let (_dir, broker) = dev_broker();
    let quinn = felix_client::quic_client_config_from_file(&broker.ca_file(), false).unwrap();
    let mut config = felix_client::ClientConfig::from_env_or_yaml(quinn, None).unwrap();
    config.auth_tenant_id = Some("dev".to_string());
    config.auth_token = Some(broker.token());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = felix_client::ClusterClient::connect(&[broker.listen], "localhost", config)
            .await
            .unwrap();
        // One record per publish, as the chaos runs write them: the log holds 200,000
        // one-record batches, each its own event on the replay.
        let mut tasks = Vec::new();
        for p in 0..PUBLISHERS {
            let c = c.client();
            tasks.push(tokio::spawn(async move {
                for i in 0..n / PUBLISHERS {
                    c.publish(
                        "dev",
                        "default",
                        "replay",
                        format!("p{p}/{i}").into_bytes(),
                        felix_client::AckMode::PerMessage,
                    )
                    .await
                    .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let started = std::time::Instant::now();
        let mut sub = c
            .subscribe_from(
                "dev",
                "default",
                "replay",
                Some(felix_client::StartPosition::Earliest),
            )
            .await
            .unwrap();
        let mut got: Vec<(u64, Vec<u8>)> = Vec::new();
        while (got.len() as u64) < n {
            let e = tokio::time::timeout(Duration::from_secs(10), sub.next_event())
                .await
                .unwrap_or_else(|_| panic!("quiet after {} records", got.len()))
                .unwrap_or_else(|e| panic!("lost after {} records: {e}", got.len()))
                .unwrap_or_else(|| panic!("ended after {} records", got.len()));
            got.push((e.offset.expect("offsets"), e.payload.to_vec()));
            // Slower than the broker sends, whatever this machine's speed: the replay
            // must outrun its reader.
            if got.len().is_multiple_of(5_000) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        eprintln!(
            "read {n} records back in {:?}; reads the driver's check forced: {:?}",
            started.elapsed(),
            broker.metric("felix_broker_quic_missed_wakeups_total")
        );
        assert!(
            got.iter().enumerate().all(|(i, (o, _))| *o == i as u64),
            "every offset once, in order"
        );
        let mut seen = std::collections::HashSet::new();
        assert!(
            got.iter().all(|(_, p)| seen.insert(p.clone())),
            "no record twice"
        );
    });
}

/// Publishes `n` records of `size` bytes to `dev/default/h`, request ids from `from + 1`,
/// and waits for their acks.
async fn publish(broker: &BrokerProcess, conn: &quinn::Connection, from: u64, n: u64, size: usize) {
    let (mut s, mut r) = conn.open_bi().await.unwrap();
    s.write_all(&raw_auth("dev", &broker.token()))
        .await
        .unwrap();
    for i in from..from + n {
        let p = raw_publish(("dev", "default", "h"), b"k", &vec![7u8; size], Some(i + 1));
        s.write_all(&p).await.unwrap();
    }
    let answers = read_messages(&mut r, 1 + n as usize).await.unwrap();
    assert_eq!(answers.len(), 1 + n as usize, "every publish answered");
}

/// Batches published while a subscription's history is still on its way, past the
/// subscriber's queue, reach it once the history is read: they were dropped before the
/// live loop began counting drops, so on a quiet stream nothing ever read them back.
/// The history (32 x 64 KiB) waits on a reader with 16 KiB stream windows, and the
/// queue holds one batch.
#[test]
fn batches_dropped_while_the_history_is_sent_are_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let broker = BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        "subscriber_queue: 1\n",
        &["--shards", "1"],
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&broker).await.unwrap();
        publish(&broker, &conn, 0, 32, 64 << 10).await;
        let (_sub_ep, sub) = felix_cluster::raw_connect_small_windows(&broker)
            .await
            .unwrap();
        let (mut s, mut r) = sub.open_bi().await.unwrap();
        s.write_all(&raw_auth("dev", &broker.token()))
            .await
            .unwrap();
        let subscribe = Message::Subscribe {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: "h".into(),
            subscription_id: None,
            start: Some(felix_wire::StartPosition::Earliest),
            shard: None,
            queue_capacity: None,
        };
        s.write_all(&subscribe.to_frame()).await.unwrap();
        let answers = read_messages(&mut r, 2).await.unwrap();
        assert!(
            matches!(answers[1], Some(Message::Subscribed { .. })),
            "{answers:?}"
        );
        let mut events = sub.accept_uni().await.unwrap();
        // The history waits on the reader: five more batches, past the queue of one.
        publish(&broker, &conn, 32, 5, 16).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let offsets = read_offsets(&mut events, 37).await;
        assert_eq!(
            offsets,
            (0..37).collect::<Vec<u64>>(),
            "every record, in order"
        );
    });
}
