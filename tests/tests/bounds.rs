//! Every per-connection queue has a bound, and a hostile (authenticated) client that
//! pushes against one neither grows the broker's memory past a stated budget nor stops
//! other clients: one never reads its answers, one opens subscriptions without end, one
//! streams unacknowledged publishes to shards on both cores.

use std::time::{Duration, Instant};

use felix_cluster::{BrokerProcess, raw_connect};
use felix_wire::{ErrorCode, FrameReader, Message};

/// RSS growth allowed over the broker's idle size, in KiB: the bounds below hold the
/// queued state well under this (answers: window x frame; subscriptions: their queues;
/// publishes: the byte budget plus QUIC receive windows, and each shard log's write
/// buffers: 16 MiB staged, the round being written, a write buffer and a round of
/// spares; docs/configuration.md).
const RSS_BUDGET_KIB: u64 = 160 * 1024;

fn broker(dir: &tempfile::TempDir, config: &str) -> BrokerProcess {
    BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        config,
        &["--shards", "2", "--fsync", "none"],
    )
    .unwrap()
}

fn auth(b: &BrokerProcess) -> bytes::Bytes {
    felix_cluster::raw_auth("dev", &b.token())
}

fn publish(stream: &str, key: &[u8], payload: &[u8], ack: Option<u64>) -> bytes::Bytes {
    felix_cluster::raw_publish(("dev", "default", stream), key, payload, ack)
}

/// An unanswered-id cache put of `value` at `cache`'s `key`.
fn cache_put(cache: &str, key: &str, value: bytes::Bytes) -> bytes::Bytes {
    Message::CachePut {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: cache.into(),
        key: key.into(),
        value,
        request_id: None,
        ttl_ms: None,
    }
    .to_frame()
}

/// Another client publishes one acked record and gets its ack within 10 s.
async fn another_client_publishes(b: &BrokerProcess) {
    let (_ep, conn) = raw_connect(b).await.unwrap();
    let publish = publish("bystander", b"k", b"hello", Some(1));
    tokio::time::timeout(Duration::from_secs(10), acked(&conn, auth(b), publish))
        .await
        .expect("another client's publish is answered while the hostile one pushes");
}

/// Writes `auth` and then `publish` (acked) on a new stream of `conn`; returns once
/// the publish's ack says it was appended.
async fn acked(conn: &quinn::Connection, auth: bytes::Bytes, publish: bytes::Bytes) {
    let (mut s, mut r) = conn.open_bi().await.unwrap();
    s.write_all(&auth).await.unwrap();
    s.write_all(&publish).await.unwrap();
    read_ack(&mut r).await;
}

/// Reads the answers to an `auth` and one acked publish; the publish's must say
/// appended.
async fn read_ack(r: &mut quinn::RecvStream) {
    let frames = async {
        let mut reader = FrameReader::new(1 << 20);
        let mut n = 0;
        while n < 2 {
            let c = r.read_chunk(1 << 16, true).await.unwrap().unwrap();
            reader.push(c.bytes);
            while let Some(f) = reader.next_frame().unwrap() {
                if n == 1 {
                    let ack = felix_wire::PublishAck::decode(f.flags, &f.payload).unwrap();
                    assert_eq!(ack.status, felix_wire::binary::PublishAckStatus::Ok);
                }
                n += 1;
            }
        }
        n
    }
    .await;
    assert_eq!(frames, 2);
}

fn assert_rss_within(b: &BrokerProcess, idle_kib: u64, budget_kib: u64, what: &str) {
    let rss = b.rss_kib();
    let kinds = b.rss_kinds();
    eprintln!(
        "{what}: broker RSS {} MiB (idle {} MiB; {kinds})",
        rss / 1024,
        idle_kib / 1024
    );
    assert!(
        rss < idle_kib + budget_kib,
        "{what}: RSS {rss} KiB over idle {idle_kib} KiB + budget {budget_kib} KiB ({kinds})"
    );
}

fn assert_rss_within_budget(b: &BrokerProcess, idle_kib: u64, what: &str) {
    assert_rss_within(b, idle_kib, RSS_BUDGET_KIB, what);
}

#[test]
fn a_client_that_never_reads_its_answers_is_held_by_the_window() {
    let dir = tempfile::tempdir().unwrap();
    // Only the window holds this client: the byte budget is set out of reach.
    let b = broker(
        &dir,
        "publish_window: 64\nmax_inflight_publish_bytes: 1073741824\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        another_client_publishes(&b).await;
        let idle = b.rss_kib();
        // A client with small receive windows: the answers it never reads fill them
        // soon, and then the broker's writers wait.
        let pem = std::fs::read_to_string(b.ca_file()).unwrap();
        let roots = felix_core_runtime::quic::certs_from_pem(&pem).unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(
            felix_core_runtime::quic::client_config(
                &roots,
                false,
                felix_core_runtime::quic::TransportLimits {
                    stream_window_bytes: 16 * 1024,
                    connection_window_bytes: 256 * 1024,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let conn = ep.connect(b.listen, "localhost").unwrap().await.unwrap();
        // Several streams, each writing acked publishes and never reading an answer.
        let mut writers = Vec::new();
        for stream in 0..8u64 {
            let (mut s, r) = conn.open_bi().await.unwrap();
            let auth = auth(&b);
            writers.push(tokio::spawn(async move {
                let _keep_unread = r;
                s.write_all(&auth).await.unwrap();
                let payload = vec![7u8; 1024];
                let (mut sent, mut held) = (0u64, false);
                let until = Instant::now() + Duration::from_secs(6);
                while Instant::now() < until {
                    let frame = publish("unread", &stream.to_be_bytes(), &payload, Some(sent));
                    match tokio::time::timeout(Duration::from_millis(500), s.write_all(&frame))
                        .await
                    {
                        Ok(Ok(())) => sent += 1,
                        Ok(Err(_)) => break,
                        // Blocked by flow control: the broker stopped reading this stream.
                        Err(_) => held = true,
                    }
                }
                (sent, held)
            }));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        another_client_publishes(&b).await;
        let mut sent = 0;
        for w in writers {
            let (n, held) = w.await.unwrap();
            assert!(
                held,
                "the broker stopped reading a stream whose answers pile up"
            );
            sent += n;
        }
        eprintln!("unread answers: {sent} publishes written before flow control held them");
        // What holds this client is its streams' QUIC receive windows (8 x 8 MiB at
        // most) and 8 x 64 queued answers; without the window, answers pile up for as
        // long as the client writes (about 30 MiB a second here).
        assert_rss_within(&b, idle, 100 * 1024, "a client that never reads");
    });
}

#[test]
fn subscriptions_per_connection_are_bounded_and_refused_with_limit_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(&dir, "max_subscriptions_per_connection: 50\n");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let idle = b.rss_kib();
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        const ASKED: usize = 400;
        let sub = Message::Subscribe {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: "flood".into(),
            subscription_id: None,
            start: None,
            shard: None,
            queue_capacity: None,
        }
        .to_frame();
        let writer = tokio::spawn(async move {
            for _ in 0..ASKED {
                s.write_all(&sub).await.unwrap();
            }
            s
        });
        let mut reader = FrameReader::new(1 << 20);
        let (mut subscribed, mut refused, mut seen) = (0, 0, 0);
        while seen < ASKED + 1 {
            let c = tokio::time::timeout(Duration::from_secs(20), r.read_chunk(1 << 16, true))
                .await
                .expect("every subscribe is answered")
                .unwrap()
                .unwrap();
            reader.push(c.bytes);
            while let Some(f) = reader.next_frame().unwrap() {
                seen += 1;
                match Message::decode(&f.payload).unwrap() {
                    Message::Subscribed { .. } => subscribed += 1,
                    Message::Error {
                        code: Some(ErrorCode::LimitExceeded),
                        ..
                    } => refused += 1,
                    Message::AuthOk { .. } => {}
                    other => panic!("unexpected answer {other:?}"),
                }
            }
        }
        let _s = writer.await.unwrap();
        assert_eq!(subscribed, 50, "the bound");
        assert_eq!(refused, ASKED - 50, "the rest are refused limit_exceeded");
        assert_eq!(b.metric("felix_broker_subscriptions").unwrap(), 50);
        // Another connection has its own allowance, and other clients keep publishing.
        another_client_publishes(&b).await;
        assert_rss_within_budget(&b, idle, "a subscription flood");
    });
}

#[test]
fn unacknowledged_publishes_to_both_cores_are_held_by_the_byte_budget() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(&dir, "max_inflight_publish_bytes: 8388608\n");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        another_client_publishes(&b).await;
        let idle = b.rss_kib();
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        // Keys for both shards of a 2-shard stream: one is owned by the other core.
        let payload = vec![1u8; 60 * 1024];
        let until = Instant::now() + Duration::from_secs(4);
        let flood = tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < until {
                let frame = publish("flood", &i.to_be_bytes(), &payload, None);
                if s.write_all(&frame).await.is_err() {
                    break;
                }
                i += 1;
            }
            (i, s)
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mid = b.rss_kib();
        another_client_publishes(&b).await;
        let (sent, _s) = flood.await.unwrap();
        eprintln!(
            "unacked flood: {sent} x 60 KiB publishes, RSS mid-flood {} MiB",
            mid / 1024
        );
        assert_rss_within_budget(&b, idle, "an unacknowledged publish flood");
    });
}

/// Requests other than publishes are held by the same byte budget: cache puts of 1 MiB
/// pipelined on 16 streams while their cache cannot open (about 512 MiB of frames) are
/// read only up to the budget, not all held in memory; once the cache opens, every put
/// is answered.
#[test]
fn pipelined_cache_puts_are_held_by_the_byte_budget() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "fault_injection: true\nmax_inflight_publish_bytes: 8388608\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        another_client_publishes(&b).await;
        let idle = b.rss_kib();
        assert_eq!(b.http_post("/debug/hold-opens?hold=true").unwrap().0, 200);
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        const STREAMS: usize = 16;
        const PUTS: usize = 24;
        let value = bytes::Bytes::from(vec![3u8; 1 << 20]);
        let mut writers = Vec::new();
        for stream in 0..STREAMS {
            let (mut s, r) = conn.open_bi().await.unwrap();
            let (auth, value) = (auth(&b), value.clone());
            // Encoded once: the client writes as fast as the broker reads.
            let put = cache_put("held", &format!("k{stream}"), value.clone());
            writers.push(tokio::spawn(async move {
                s.write_all(&auth).await.unwrap();
                for _ in 0..PUTS {
                    s.write_all(&put).await.unwrap();
                }
                (s, r)
            }));
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_rss_within_budget(
            &b,
            idle,
            "cache puts pipelined while their cache cannot open",
        );
        assert_eq!(b.http_post("/debug/hold-opens?hold=false").unwrap().0, 200);
        for w in writers {
            let (_s, mut r) = tokio::time::timeout(Duration::from_secs(60), w)
                .await
                .expect("every put is read once the cache opens")
                .unwrap();
            let answers = read_answers(&mut r, PUTS + 1).await;
            assert!(
                answers[1..]
                    .iter()
                    .all(|a| matches!(a, Message::CacheOk { .. })),
                "{:?}",
                answers
                    .iter()
                    .find(|a| !matches!(a, Message::CacheOk { .. }))
            );
        }
        another_client_publishes(&b).await;
    });
}

/// Whole requests waiting for the byte budget count against the bound on unfinished
/// frames: 48 streams each sending one 4 MiB cache put while the cache cannot open
/// (about 250 MiB of frames read whole and waiting) close the connection (error 3).
/// Read whole, a request was no longer an unfinished frame and not yet the budget's,
/// and held outside every bound: the connection was never closed.
#[test]
fn whole_requests_waiting_for_the_budget_count_as_unfinished() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "fault_injection: true\nmax_inflight_publish_bytes: 8388608\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        another_client_publishes(&b).await;
        let idle = b.rss_kib();
        assert_eq!(b.http_post("/debug/hold-opens?hold=true").unwrap().0, 200);
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let value = bytes::Bytes::from(vec![3u8; 4 << 20]);
        for stream in 0..48 {
            // Opening fails once the broker has closed the connection.
            let Ok((mut s, r)) = conn.open_bi().await else {
                break;
            };
            let put = cache_put("held", &format!("k{stream}"), value.clone());
            let auth = auth(&b);
            tokio::spawn(async move {
                let _r = r;
                let _ = s.write_all(&auth).await;
                let _ = s.write_all(&put).await;
                std::future::pending::<()>().await;
            });
        }
        tokio::time::timeout(Duration::from_secs(30), async {
            while conn.close_reason().is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the connection is closed");
        assert!(closed_for_unfinished_frames(&conn));
        // Not asserted: what the allocator keeps of freed frames stays in the RSS.
        eprintln!(
            "broker RSS {} MiB after the close (idle {} MiB)",
            b.rss_kib() >> 10,
            idle >> 10
        );
        assert_eq!(b.http_post("/debug/hold-opens?hold=false").unwrap().0, 200);
        another_client_publishes(&b).await;
    });
}

/// Answers done ahead of their turn are counted until the writer takes them: 4 streams
/// each holding a waiting group poll and 120 reads of a 512 KiB cache value behind it
/// read requests only up to 8 MiB of such answers a stream (RSS stays within bounds;
/// 370-580 MiB over idle without it) and every read is answered once the polls end, or,
/// when the reads were taken in before their answers were known, the connection is
/// closed past its bound on unwritten answers. Done, those answers were held outside
/// every bound: a window of them per stream. The connection's bound is 96 MiB here:
/// at the default 256 MiB, a run whose reader took in 60% of the reads before their
/// answers were known held ~190 MiB (within that bound, over the test's RSS budget;
/// seen once in CI).
#[test]
fn answers_done_behind_a_waiting_one_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_inflight_publish_bytes: 8388608\nmax_unwritten_answer_bytes_per_connection: 100663296\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        an_empty_group(&b, "q").await;
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        let put = cache_put("gets", "big", bytes::Bytes::from(vec![4u8; 512 << 10]));
        s.write_all(&put).await.unwrap();
        read_answers(&mut r, 2).await;
        another_client_publishes(&b).await;
        let idle = b.rss_kib();
        const GETS: usize = 120;
        let get = Message::CacheGet {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            cache: "gets".into(),
            key: "big".into(),
            request_id: None,
        }
        .to_frame();
        let mut streams = Vec::new();
        for _ in 0..4 {
            let (mut s, r) = conn.open_bi().await.unwrap();
            let (auth, get) = (auth(&b), get.clone());
            let writer = tokio::spawn(async move {
                s.write_all(&auth).await.unwrap();
                s.write_all(&poll("q", 0, 8_000, 1)).await.unwrap();
                for _ in 0..GETS {
                    s.write_all(&get).await.unwrap();
                }
                s
            });
            streams.push((writer, r));
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        // Reads already taken in when their answers are known (the reader can run ahead
        // of the reads' tasks) count against the connection's bound at once: past it
        // (up to 320 MiB of them here, over 96) the connection is closed, as for
        // answers left unread. Either way nothing is held outside a bound.
        if let Some(reason) = conn.close_reason() {
            match reason {
                quinn::ConnectionError::ApplicationClosed(c) => {
                    assert_eq!(u64::from(c.error_code), 4, "{c:?}");
                    eprintln!("the connection was closed at its bound: {c:?}");
                }
                other => panic!("closed otherwise: {other:?}"),
            }
            return;
        }
        eprintln!("the connection stayed within its bound; checking the broker's RSS");
        assert_rss_within_budget(&b, idle, "reads done behind waiting polls");
        // Every read of one stream is answered once its poll ends (read whole: the
        // others would only take time).
        for (i, (writer, mut r)) in streams.into_iter().enumerate() {
            let answers = read_answers(&mut r, if i == 0 { GETS + 2 } else { 3 }).await;
            assert!(
                matches!(&answers[1], Message::GroupRecords { records, .. } if records.is_empty()),
                "{:?}",
                answers[1]
            );
            assert!(
                answers[2..]
                    .iter()
                    .all(|a| matches!(a, Message::CacheValue { value: Some(v), .. } if v.len() == 512 << 10)),
                "every read is answered"
            );
            if i == 0 {
                drop(writer.await.unwrap());
            }
        }
    });
}

/// Gets of a large value pipelined on several streams, no answer read: past the
/// connection's bound on unwritten answers the connection is closed before the rest are
/// encoded. Each get's answer (base64 of the value) was encoded in its own task before
/// the bound counted any, so 4 streams of 64 gets of an 8 MiB value encoded about
/// 2.7 GB, the close coming after all of them.
#[test]
fn pipelined_gets_of_a_large_value_are_bounded_before_they_are_encoded() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_unwritten_answer_bytes_per_connection: 67108864\n",
    );
    // The broker's peak resident size so far (`VmHWM`), in KiB.
    let peak_kib = || {
        std::fs::read_to_string(format!("/proc/{}/status", b.pid()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        let value = bytes::Bytes::from(vec![7u8; 8 << 20]);
        s.write_all(&cache_put("large", "v", value)).await.unwrap();
        read_answers(&mut r, 2).await;
        let before = peak_kib().max(b.rss_kib());
        let get = Message::CacheGet {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            cache: "large".into(),
            key: "v".into(),
            request_id: None,
        }
        .to_frame();
        let mut streams = Vec::new();
        for _ in 0..4 {
            let (mut s, r) = conn.open_bi().await.unwrap();
            s.write_all(&auth(&b)).await.unwrap();
            for _ in 0..64 {
                s.write_all(&get).await.unwrap();
            }
            streams.push((s, r));
        }
        let reason = tokio::time::timeout(Duration::from_secs(60), conn.closed())
            .await
            .expect("the connection is closed past its bound");
        // (Its code can be lost under a full congestion window, quinn-rs/quinn#2785:
        // then the client learns of the close from a stateless reset.)
        match reason {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(u64::from(c.error_code), 4, "{c:?}")
            }
            quinn::ConnectionError::Reset => {}
            other => panic!("closed otherwise: {other:?}"),
        }
        let peak = peak_kib();
        eprintln!(
            "gets of a large value: broker peak RSS {} MiB (before them {} MiB)",
            peak / 1024,
            before / 1024
        );
        assert!(
            peak < before + RSS_BUDGET_KIB,
            "peak RSS {peak} KiB over {before} KiB + budget {RSS_BUDGET_KIB} KiB"
        );
    });
}

/// A request that began a shard's first open after a restart and was dropped before
/// it ended (its connection went away) leaves the shard to be opened again: the slot
/// stayed `opening`, and every later request of the shard on that core waited for
/// good. One core, so the group poll that begins the open runs on the shard's core;
/// it is dropped when the answer ahead of it on its stream fails to go out.
#[test]
fn an_open_begun_by_a_request_whose_client_left_does_not_hold_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        "fault_injection: true\n",
        &["--shards", "1", "--fsync", "none", "--cores", "0"],
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        acked(
            &conn,
            auth(&b),
            publish("never-opened", b"k", b"v", Some(1)),
        )
        .await;
    });
    // Restarted, the stream exists and its shard is not open yet.
    b.restart().unwrap();
    rt.block_on(async {
        // A group of `q` with nothing to hand out: its one record claimed.
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        acked(&conn, auth(&b), publish("q", b"k", b"only", Some(1))).await;
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        s.write_all(&poll("q", 0, 0, 1)).await.unwrap();
        read_answers(&mut r, 2).await;
        assert_eq!(b.http_post("/debug/hold-opens?hold=true").unwrap().0, 200);
        let (ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, _r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        // A waiting poll, then one that opens the shard (held).
        s.write_all(&poll("q", 0, 1_500, 2)).await.unwrap();
        s.write_all(&poll("never-opened", 0, 0, 3)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        conn.close(0u32.into(), b"gone");
        drop(ep);
        // The waiting poll's answer fails to go out: the stream's answers are dropped.
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        assert_eq!(b.http_post("/debug/hold-opens?hold=false").unwrap().0, 200);
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        tokio::time::timeout(
            Duration::from_secs(5),
            acked(
                &conn,
                auth(&b),
                publish("never-opened", b"k", b"v", Some(1)),
            ),
        )
        .await
        .expect("the shard opens for the next request");
    });
}

/// Request bytes in flight on a core are bounded for all its connections together, not
/// only each connection's own: with appends held (the shard's open held back), four
/// connections of 8 MiB each took 32 MiB into a core whose bound is 16 MiB, and a
/// core's 10,000 connections could each have held their 64 MiB. Once the appends go,
/// every publish is acknowledged (the ones that waited for room too).
#[test]
fn request_bytes_in_flight_are_bounded_for_a_core_as_a_whole() {
    const MIB: usize = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let b = BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        "fault_injection: true\nmax_inflight_publish_bytes: 8388608\n\
         max_inflight_request_bytes_per_core: 16777216\n",
        &["--shards", "1", "--fsync", "none", "--cores", "0"],
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        assert_eq!(b.http_post("/debug/hold-opens?hold=true").unwrap().0, 200);
        let mut writers = Vec::new();
        for c in 0..4 {
            let (ep, conn) = raw_connect(&b).await.unwrap();
            let (mut s, r) = conn.open_bi().await.unwrap();
            s.write_all(&auth(&b)).await.unwrap();
            // Each on a stream of its own: one stream's publishes wait their turn there.
            let auth = auth(&b);
            let stream_writes = tokio::spawn(async move {
                let mut streams = Vec::new();
                for i in 0..8u64 {
                    let (mut s, r) = conn.open_bi().await.unwrap();
                    s.write_all(&auth).await.unwrap();
                    let p = publish("held", &[c, i as u8], &vec![1u8; MIB - 4096], Some(1));
                    s.write_all(&p).await.unwrap();
                    streams.push((s, r));
                }
                (ep, conn, streams)
            });
            writers.push((s, r, stream_writes));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let in_flight = b.metric("felix_broker_request_bytes_in_flight").unwrap();
        assert!(
            in_flight as usize <= 16 * MIB,
            "{in_flight} request bytes in flight on a core bounded at 16 MiB"
        );
        assert!(
            in_flight as usize >= 8 * MIB,
            "{in_flight}: the bound was used"
        );
        assert_eq!(b.http_post("/debug/hold-opens?hold=false").unwrap().0, 200);
        for (_s, _r, stream_writes) in writers {
            let (_ep, _conn, streams) = stream_writes.await.unwrap();
            for (_s, mut r) in streams {
                tokio::time::timeout(Duration::from_secs(20), read_ack(&mut r))
                    .await
                    .expect("every publish is acknowledged once appends go");
            }
        }
        assert_eq!(b.metric("felix_broker_request_bytes_in_flight").unwrap(), 0);
    });
}

/// Unacknowledged publishes, each its own task until written, are held against the
/// connection's budget at no less than a request's own cost
/// (`dispatch::REQUEST_MIN_CHARGE`), not by their records alone: 40,000 publishes of
/// one empty record each, pipelined while the shard's open is held, leave at most
/// `max_inflight_publish_bytes / REQUEST_MIN_CHARGE` of them in flight, and the
/// broker's memory grows by about that many. Charged 48 bytes each (a record's
/// overhead), 21,845 waited in 1 MiB of budget, each holding its task and its append.
#[test]
fn unacknowledged_publishes_in_flight_are_charged_a_requests_cost() {
    let dir = tempfile::tempdir().unwrap();
    let b = BrokerProcess::start_dev_with_config(
        std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        dir.path(),
        "fault_injection: true\nmax_inflight_publish_bytes: 1048576\n",
        &["--shards", "1", "--fsync", "none", "--cores", "0"],
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        assert_eq!(b.http_post("/debug/hold-opens?hold=true").unwrap().0, 200);
        let before = b.rss_kib();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        const PUBLISHES: usize = 40_000;
        let mut frames = Vec::new();
        for i in 0..PUBLISHES {
            frames.extend_from_slice(&publish("tiny", &(i as u64).to_be_bytes(), b"", None));
        }
        let sent = tokio::spawn(async move {
            let _ = s.write_all(&frames).await;
            s
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        let grown = b.rss_kib().saturating_sub(before);
        let in_flight = b.metric("felix_broker_request_bytes_in_flight").unwrap();
        assert!(
            in_flight > 512 << 10 && in_flight <= 1 << 20,
            "{in_flight} bytes in flight, bounded at 1 MiB"
        );
        // 256 requests of 4 KiB; about 94 MiB when 21,845 were let in.
        assert!(grown < 24 << 10, "the broker grew {grown} KiB");
        assert_eq!(b.http_post("/debug/hold-opens?hold=false").unwrap().0, 200);
        let mut s = tokio::time::timeout(Duration::from_secs(60), sent)
            .await
            .expect("every publish is read once appends go")
            .unwrap();
        // Behind every one of them on the stream: it lands after all 40,000.
        s.write_all(&publish("tiny", b"last", b"", Some(7)))
            .await
            .unwrap();
        let mut reader = FrameReader::new(1 << 20);
        let mut frames = Vec::new();
        while frames.len() < 2 {
            let c = tokio::time::timeout(Duration::from_secs(30), r.read_chunk(1 << 16, true))
                .await
                .expect("answered")
                .unwrap()
                .unwrap();
            reader.push(c.bytes);
            while let Some(f) = reader.next_frame().unwrap() {
                frames.push(f);
            }
        }
        let ack = felix_wire::PublishAck::decode(frames[1].flags, &frames[1].payload).unwrap();
        assert_eq!(ack.status, felix_wire::binary::PublishAckStatus::Ok);
        assert_eq!(ack.first_offset, Some(felix_wire::Offset(PUBLISHES as u64)));
        assert_eq!(b.metric("felix_broker_request_bytes_in_flight").unwrap(), 0);
    });
}

/// Large whole frames written on many streams of one connection at once, 64 KiB of
/// each in turn (64 MiB, twice the connection's QUIC receive window), are all read and
/// answered. A bound on what the broker reads that leaves some streams unread lets
/// their bytes hold the connection's window while another stream waits for the rest
/// of its frame: a bound on unfinished frames built that way was reverted for it.
#[test]
fn large_frames_interleaved_on_many_streams_of_one_connection_all_complete() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(&dir, "");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let frame = publish("whole", b"k", &vec![5u8; 4 << 20], Some(1));
        let mut streams = Vec::new();
        for _ in 0..16 {
            let (mut s, r) = conn.open_bi().await.unwrap();
            s.write_all(&auth(&b)).await.unwrap();
            streams.push((s, r));
        }
        tokio::time::timeout(Duration::from_secs(60), async {
            for at in (0..frame.len()).step_by(64 << 10) {
                let piece = frame.slice(at..(at + (64 << 10)).min(frame.len()));
                for (s, _) in &mut streams {
                    s.write_all(&piece).await.unwrap();
                }
            }
            for (_, r) in &mut streams {
                read_ack(r).await;
            }
        })
        .await
        .expect("16 x 4 MiB publishes written interleaved on one connection are all acknowledged");
    });
}

/// A group poll of `stream`'s `shard` that waits up to `wait_ms` for records.
fn poll(stream: &str, shard: u32, wait_ms: u64, request_id: u64) -> bytes::Bytes {
    Message::GroupPoll {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        stream: stream.into(),
        shard: felix_wire::ShardId(shard),
        group: "g".into(),
        max_records: 1000,
        wait_ms,
        request_id: felix_wire::RequestId(request_id),
        consumer: None,
        reclaim: false,
        visibility_ms: Some(120_000),
    }
    .to_frame()
}

/// Creates `stream` (2 shards) with one record and claims it for group `g` for two
/// minutes, so that polls of either shard find nothing and wait.
async fn an_empty_group(b: &BrokerProcess, stream: &str) {
    let (_ep, conn) = raw_connect(b).await.unwrap();
    acked(&conn, auth(b), publish(stream, b"k", b"only", Some(1))).await;
    for shard in 0..2 {
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(b)).await.unwrap();
        s.write_all(&poll(stream, shard, 0, 1)).await.unwrap();
        let answers = read_answers(&mut r, 2).await;
        assert!(
            matches!(answers[1], Message::GroupRecords { .. }),
            "{answers:?}"
        );
    }
}

/// Reads `n` answers from `r`.
async fn read_answers(r: &mut quinn::RecvStream, n: usize) -> Vec<Message> {
    let mut reader = FrameReader::new(1 << 20);
    let mut answers = Vec::new();
    while answers.len() < n {
        let c = tokio::time::timeout(Duration::from_secs(20), r.read_chunk(1 << 16, true))
            .await
            .expect("answered")
            .unwrap()
            .unwrap();
        reader.push(c.bytes);
        while let Some(f) = reader.next_frame().unwrap() {
            answers.push(Message::decode(&f.payload).unwrap());
        }
    }
    answers
}

/// Writes `polls` long polls (each waiting up to `wait_ms`) on `streams` streams of
/// one connection; returns the streams, which must stay open for the polls to wait.
async fn long_polls(
    b: &BrokerProcess,
    conn: &quinn::Connection,
    stream: &str,
    shards: &[u32],
    polls: usize,
    streams: usize,
    wait_ms: u64,
) -> Vec<(quinn::SendStream, quinn::RecvStream)> {
    let mut open = Vec::new();
    for i in 0..streams {
        let (mut s, r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(b)).await.unwrap();
        for n in (i..polls).step_by(streams) {
            let shard = shards[n % shards.len()];
            s.write_all(&poll(stream, shard, wait_ms, n as u64 + 1))
                .await
                .unwrap();
        }
        open.push((s, r));
    }
    open
}

/// Waits until the broker has cut `expected` polls' waits, and checks it cuts no more.
async fn assert_waits_cut(b: &BrokerProcess, expected: u64, what: &str) {
    let cut = || b.metric("felix_broker_poll_waits_cut_total").unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while cut() < expected && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(cut(), expected, "{what}");
}

/// One connection's long polls wait only up to its allowance; past it they answer
/// without waiting (empty, after a short pause), another connection's polls still
/// wait, and the allowance comes back as polls end.
#[test]
fn a_connections_waiting_polls_are_bounded_and_the_rest_answer_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "follow_load: false\nmax_waiting_polls_per_connection: 8\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        an_empty_group(&b, "q").await;
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        // One poll per stream: a stream's answers go out in order.
        let sent = Instant::now();
        let open = long_polls(&b, &conn, "q", &[0, 1], 40, 40, 4_000).await;
        assert_waits_cut(&b, 32, "40 polls past an allowance of 8").await;
        let mut waiting = Vec::new();
        let mut answered_streams = Vec::new();
        for (s, mut r) in open {
            // auth_ok and the poll's answer; a waiting poll's stream times out having read
            // its auth_ok.
            let answered = tokio::time::timeout(Duration::from_millis(200), read_answers(&mut r, 2));
            match answered.await {
                Ok(answers) => assert!(
                    matches!(&answers[1], Message::GroupRecords { records, .. } if records.is_empty()),
                    "{answers:?}"
                ),
                Err(_) => waiting.push(r),
            }
            answered_streams.push(s);
        }
        assert_eq!(waiting.len(), 8, "the polls past the allowance answer, empty");
        assert!(sent.elapsed() < Duration::from_secs(4), "before the others' wait ends");
        // Another connection has an allowance of its own: its poll waits.
        let (_ep2, other) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = other.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        let asked = Instant::now();
        s.write_all(&poll("q", 0, 1_500, 1)).await.unwrap();
        read_answers(&mut r, 2).await;
        assert!(
            asked.elapsed() >= Duration::from_millis(1_000),
            "another connection's poll waited {:?}",
            asked.elapsed()
        );
        // Once the 8 waiting polls end, the connection may wait again.
        for r in &mut waiting {
            let answers = read_answers(r, 1).await;
            assert!(matches!(&answers[0], Message::GroupRecords { .. }));
        }
        assert!(sent.elapsed() >= Duration::from_secs(3), "they waited");
        let asked = Instant::now();
        let mut again = long_polls(&b, &conn, "q", &[0, 1], 8, 8, 1_500).await;
        for (_, r) in &mut again {
            read_answers(r, 2).await;
        }
        drop(answered_streams);
        assert!(
            asked.elapsed() >= Duration::from_millis(1_000),
            "polls within the allowance waited again: {:?}",
            asked.elapsed()
        );
        assert_eq!(
            b.metric("felix_broker_poll_waits_cut_total").unwrap(),
            32,
            "none of them was cut"
        );
    });
}

/// Long polls one core holds waiting at another are bounded below the pair's request
/// slots (a quarter of them), however many connections send them: past the bound a poll
/// answers at once, and the slots every other cross-core request needs stay free.
#[test]
fn long_polls_across_cores_hold_at_most_a_quarter_of_the_request_slots() {
    const WAITING_MAX: u64 = 2048;
    const PER_SHARD: usize = WAITING_MAX as usize + 100;
    let dir = tempfile::tempdir().unwrap();
    // Shards stay on their cores (no load following), so one of the two is remote.
    let b = broker(
        &dir,
        "follow_load: false\nmax_waiting_polls_per_connection: 100000\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        an_empty_group(&b, "q").await;
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        // Every stream of the connection lands on one core: polls of both shards send
        // one shard's across. Streams hold at most 256 answers each.
        let open = long_polls(&b, &conn, "q", &[0, 1], 2 * PER_SHARD, 40, 60_000).await;
        assert_waits_cut(
            &b,
            PER_SHARD as u64 - WAITING_MAX,
            "the remote shard's polls past the bound",
        )
        .await;
        // The other cross-core requests go on: a publish to each shard is acknowledged.
        for key in 0u64..8 {
            let (_ep, c) = raw_connect(&b).await.unwrap();
            let p = publish("q", &key.to_be_bytes(), b"after", Some(1));
            tokio::time::timeout(Duration::from_secs(10), acked(&c, auth(&b), p))
                .await
                .expect("a publish is answered while polls wait");
        }
        drop(open);
    });
}

/// A prefix watch of `cache`'s `shard` for keys under `prefix`, from now.
fn watch(cache: &str, prefix: &str, shard: u32) -> bytes::Bytes {
    Message::CacheWatch {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: cache.into(),
        key: None,
        prefix: Some(prefix.into()),
        shard: Some(felix_wire::ShardId(shard)),
        from_offset: None,
        retained: false,
        subscription_id: None,
    }
    .to_frame()
}

/// Cache watches' long polls one core holds waiting at another share the group polls'
/// bound (a quarter of the pair's request slots): past it a watch's wait is cut, and
/// the slots every other cross-core request needs stay free. Uncapped, a few
/// connections' watches of an idle cache held every slot to the cache's core.
#[test]
fn cache_watches_across_cores_share_the_long_polls_bound() {
    const WAITING_MAX: usize = 2048;
    const PER_SHARD: usize = WAITING_MAX + 100;
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "follow_load: false\nmax_subscriptions_per_connection: 100000\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        let put = Message::CachePut {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            cache: "w".into(),
            key: "k".into(),
            value: bytes::Bytes::from_static(b"v"),
            request_id: Some(felix_wire::RequestId(1)),
            ttl_ms: None,
        };
        s.write_all(&put.to_frame()).await.unwrap();
        read_answers(&mut r, 2).await;
        // Every stream of the connection lands on one core: watches of both shards send
        // one shard's across. Each watch is a stream from the broker: the client lets it
        // open enough.
        let (_wep, watcher) = felix_cluster::raw_connect_with(
            b.listen,
            &b.ca_file(),
            felix_core_runtime::quic::TransportLimits {
                max_streams: 10_000,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let mut open = Vec::new();
        for i in 0..40 {
            let (mut s, r) = watcher.open_bi().await.unwrap();
            s.write_all(&auth(&b)).await.unwrap();
            for n in (i..2 * PER_SHARD).step_by(40) {
                s.write_all(&watch("w", "idle-", (n % 2) as u32))
                    .await
                    .unwrap();
            }
            open.push((s, r));
        }
        let cut = || b.metric("felix_broker_poll_waits_cut_total").unwrap();
        let until = Instant::now() + Duration::from_secs(30);
        while cut() < 100 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            cut() >= 100,
            "the remote shard's watches past the bound are cut: {}",
            cut()
        );
        // The other cross-core requests go on: a publish to each shard is acknowledged.
        for key in 0u64..8 {
            let (_ep, c) = raw_connect(&b).await.unwrap();
            let p = publish("q", &key.to_be_bytes(), b"after", Some(1));
            tokio::time::timeout(Duration::from_secs(10), acked(&c, auth(&b), p))
                .await
                .expect("a publish is answered while watches wait");
        }
        drop(open);
    });
}

/// Opens a connection and writes on each of `streams` streams the first `written` bytes
/// of a publish of `frame_payload` bytes, never the rest. Returns the connection once
/// the broker has read them all or closed it.
async fn unfinished_frames(
    b: &BrokerProcess,
    streams: usize,
    frame_payload: usize,
    written: usize,
) -> (quinn::Endpoint, quinn::Connection) {
    let (ep, conn) = raw_connect(b).await.unwrap();
    let frame = publish("unfinished", b"k", &vec![3u8; frame_payload], Some(1));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..streams {
        let (mut s, r) = conn.open_bi().await.unwrap();
        let (auth, part, done) = (auth(b), frame.slice(..written), done.clone());
        tokio::spawn(async move {
            let _r = r;
            // Fails once the broker closes the connection.
            if s.write_all(&auth).await.is_ok() && s.write_all(&part).await.is_ok() {
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // Keep the stream open, its frame unfinished.
                std::future::pending::<()>().await;
            }
        });
    }
    // A write completes once the broker has read most of it (it grants the window
    // back only then); the last bytes it reads soon after.
    tokio::time::timeout(Duration::from_secs(20), async {
        while conn.close_reason().is_none()
            && done.load(std::sync::atomic::Ordering::SeqCst) < streams
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every part is written or the connection closed");
    tokio::time::sleep(Duration::from_millis(500)).await;
    (ep, conn)
}

/// Whether the broker closed `conn` for the unfinished frames it held (error 3).
fn closed_for_unfinished_frames(conn: &quinn::Connection) -> bool {
    match conn.close_reason() {
        Some(quinn::ConnectionError::ApplicationClosed(c)) => {
            assert_eq!(u64::from(c.error_code), 3, "{c:?}");
            true
        }
        None => false,
        Some(other) => panic!("closed otherwise: {other:?}"),
    }
}

/// A connection whose streams hold more bytes of begun, unfinished frames than its
/// bound is closed with error 3 (the broker no longer holds them); other clients go on.
#[test]
fn a_connection_holding_too_many_unfinished_frames_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_unfinished_frame_bytes_per_connection: 33554432\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // 2 x 10 MiB of 12 MiB frames (charged what they announce, 24 MiB): within
        // 32 MiB, held.
        let (_ep, within) = unfinished_frames(&b, 2, 12 << 20, 10 << 20).await;
        assert!(!closed_for_unfinished_frames(&within), "within the bound");
        // 3 x 10 MiB (36 MiB announced): past it.
        let (_ep2, past) = unfinished_frames(&b, 3, 12 << 20, 10 << 20).await;
        tokio::time::timeout(Duration::from_secs(10), past.closed())
            .await
            .expect("the connection past its bound is closed");
        assert!(closed_for_unfinished_frames(&past));
        assert!(
            !closed_for_unfinished_frames(&within),
            "another connection stays"
        );
        assert_eq!(
            b.metric("felix_broker_unfinished_frames_closed_total")
                .unwrap(),
            1
        );
        another_client_publishes(&b).await;
    });
}

/// When a core's connections together hold more unfinished frames than the core's
/// bound, the one holding the most is closed, not the small one whose bytes crossed it.
#[test]
fn past_a_cores_bound_on_unfinished_frames_the_largest_holder_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_unfinished_frame_bytes_per_connection: 67108864\n\
         max_unfinished_frame_bytes_per_core: 104857600\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Four connections of 44 MiB each on two cores (100 MiB each): a core with
        // three closes one of them as the third crosses; a core with two holds 88 MiB.
        let mut large = Vec::new();
        for _ in 0..4 {
            large.push(unfinished_frames(&b, 4, 12 << 20, 11 << 20).await);
        }
        // Then six of 11 MiB: on a core with a large holder left, one of them crosses
        // the bound, and a large holder is closed for it. Six together (66 MiB) fit.
        let mut small = Vec::new();
        for _ in 0..6 {
            small.push(unfinished_frames(&b, 1, 12 << 20, 11 << 20).await);
        }
        let closed = large
            .iter()
            .filter(|(_, c)| closed_for_unfinished_frames(c))
            .count();
        assert!(closed >= 1, "{closed} of 4 large holders closed");
        for (_, c) in &small {
            assert!(
                !closed_for_unfinished_frames(c),
                "a small holder was closed"
            );
        }
        assert_eq!(
            b.metric("felix_broker_unfinished_frames_closed_total")
                .unwrap(),
            closed as u64
        );
        another_client_publishes(&b).await;
    });
}

/// A connection with small receive windows whose `streams` streams each ask for a
/// 4 MiB stream read of `stream` and never read the answer. Returns once the broker has
/// had time to answer them all.
async fn unread_reads(
    b: &BrokerProcess,
    stream: &str,
    streams: usize,
) -> (quinn::Endpoint, quinn::Connection) {
    let (ep, conn) = felix_cluster::raw_connect_small_windows(b).await.unwrap();
    for i in 0..streams {
        let (mut s, r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(b)).await.unwrap();
        let read = Message::StreamRead {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: stream.into(),
            shard: felix_wire::ShardId(i as u32 % 2),
            from: felix_wire::Offset(0),
            end: None,
            max_records: None,
            max_bytes: Some(4 << 20),
            request_id: felix_wire::RequestId(1),
        };
        s.write_all(&read.to_frame()).await.unwrap();
        // Neither stream half is closed or read: the answer waits in the broker.
        std::mem::forget((s, r));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    (ep, conn)
}

/// A connection with small receive windows holding `subscriptions` subscriptions to
/// `stream` from its earliest record, whose event streams it never reads. Returns once
/// the broker has had time to begin them all.
async fn unread_subscriptions(
    b: &BrokerProcess,
    stream: &str,
    subscriptions: usize,
) -> (quinn::Endpoint, quinn::Connection) {
    let (ep, conn) = felix_cluster::raw_connect_small_windows(b).await.unwrap();
    let (mut s, r) = conn.open_bi().await.unwrap();
    s.write_all(&auth(b)).await.unwrap();
    for i in 0..subscriptions {
        let sub = Message::Subscribe {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: stream.into(),
            subscription_id: None,
            start: Some(felix_wire::message::StartPosition::Earliest),
            shard: Some(felix_wire::ShardId(i as u32 % 2)),
            queue_capacity: None,
        };
        s.write_all(&sub.to_frame()).await.unwrap();
    }
    std::mem::forget((s, r));
    tokio::time::sleep(Duration::from_secs(3)).await;
    (ep, conn)
}

/// Subscribers that stop reading count against the same bound: each holds a history
/// read (about 1 MiB) the broker cannot hand to QUIC.
#[test]
fn a_connection_leaving_too_many_events_unread_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_unwritten_answer_bytes_per_connection: 33554432\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // About 8 MiB on each shard of a 2-shard stream.
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        for key in 0u64..32 {
            let p = publish(
                "history",
                &key.to_be_bytes(),
                &vec![7u8; 512 << 10],
                Some(1),
            );
            acked(&conn, auth(&b), p).await;
        }
        // 8 stalled subscriptions hold about 8 MiB: within 32 MiB.
        let (_ep1, within) = unread_subscriptions(&b, "history", 8).await;
        // 48 hold about 48 MiB: past it.
        let (_ep2, past) = unread_subscriptions(&b, "history", 48).await;
        tokio::time::timeout(Duration::from_secs(10), past.closed())
            .await
            .expect("the connection past its bound is closed");
        match past.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                assert_eq!(u64::from(c.error_code), 4, "{c:?}")
            }
            other => panic!("closed otherwise: {other:?}"),
        }
        assert!(within.close_reason().is_none(), "within the bound");
        assert_eq!(
            b.metric("felix_broker_unread_answers_closed_total")
                .unwrap(),
            1
        );
        another_client_publishes(&b).await;
    });
}

/// A retained cache watch's snapshot counts, with the page being written, against the
/// bound on unread answers: two watches of a cache holding 48 MiB that stop reading
/// close their connection (error 4). The snapshot was held whole for the watch's life
/// and only its 1 MiB page counted.
#[test]
fn a_watchers_unread_snapshot_counts_against_the_unread_bound() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_unwritten_answer_bytes_per_connection: 33554432\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        const VALUES: usize = 48;
        for i in 0..VALUES {
            let put = cache_put(
                "watched",
                &format!("k{i}"),
                bytes::Bytes::from(vec![5u8; 1 << 20]),
            );
            s.write_all(&put).await.unwrap();
        }
        let answers = read_answers(&mut r, VALUES + 1).await;
        assert!(
            answers[1..]
                .iter()
                .all(|a| matches!(a, Message::CacheOk { .. })),
            "{answers:?}"
        );
        // Retained watches of both shards, never read.
        let (_ep2, watcher) = felix_cluster::raw_connect_small_windows(&b).await.unwrap();
        let (mut s, r) = watcher.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        for shard in 0..2 {
            let watch = Message::CacheWatch {
                tenant_id: "dev".into(),
                namespace: "default".into(),
                cache: "watched".into(),
                key: None,
                prefix: Some(String::new()),
                shard: Some(felix_wire::ShardId(shard)),
                from_offset: None,
                retained: true,
                subscription_id: None,
            };
            s.write_all(&watch.to_frame()).await.unwrap();
        }
        std::mem::forget((s, r));
        tokio::time::timeout(Duration::from_secs(15), watcher.closed())
            .await
            .expect("the watcher's connection is closed");
        match watcher.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                assert_eq!(u64::from(c.error_code), 4, "{c:?}")
            }
            other => panic!("closed otherwise: {other:?}"),
        }
        another_client_publishes(&b).await;
    });
}

/// A retained watch of shard 0 of the cache `copied`.
fn retained_watch() -> bytes::Bytes {
    Message::CacheWatch {
        tenant_id: "dev".into(),
        namespace: "default".into(),
        cache: "copied".into(),
        key: None,
        prefix: Some(String::new()),
        shard: Some(felix_wire::ShardId(0)),
        from_offset: None,
        retained: true,
        subscription_id: None,
    }
    .to_frame()
}

/// The copies of current values that starting cache watches hold are bounded for the
/// process (`max_watch_snapshot_bytes`), and given back as their watchers take them.
/// While a watcher that does not read holds most of its copy, a second retained watch
/// is refused `overloaded` (its start asked again for 3 s first). Once the first
/// watcher has gone, the second starts. Without the bound the second copy was built and
/// held too: a connection starting 1,024 watches of a large cache had the broker build
/// a copy of its keys for each at once.
#[test]
fn copies_of_current_values_held_by_starting_watches_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(&dir, "max_watch_snapshot_bytes: 6291456\n");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // About 4,000 keys of 1,000 bytes on each shard: a copy of one shard's is
        // charged about 4.3 MB, and written about 4.4 MB (5 pages).
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        const KEYS: usize = 8_000;
        for i in 0..KEYS {
            let put = cache_put(
                "copied",
                &format!("{i:0>1000}"),
                bytes::Bytes::from_static(b"v"),
            );
            s.write_all(&put).await.unwrap();
        }
        let answers = read_answers(&mut r, KEYS + 1).await;
        assert!(
            answers[1..]
                .iter()
                .all(|a| matches!(a, Message::CacheOk { .. })),
            "{:?}",
            answers
                .iter()
                .find(|a| !matches!(a, Message::CacheOk { .. }))
        );
        // A watcher that does not read: it holds the copy past its first page.
        let (_ep2, watcher) = felix_cluster::raw_connect_small_windows(&b).await.unwrap();
        let (mut s, mut r) = watcher.open_bi().await.unwrap();
        s.write_all(&auth(&b)).await.unwrap();
        s.write_all(&retained_watch()).await.unwrap();
        let count = match &read_answers(&mut r, 2).await[1] {
            Message::CacheWatchStarted {
                retained_count: Some(n),
                ..
            } => *n,
            other => panic!("not started: {other:?}"),
        };
        assert!(count > 3_000, "{count} values on shard 0");
        let held = b.metric("felix_broker_watch_snapshot_bytes").unwrap();
        assert!(held > 2 << 20, "held {held}");
        // Another connection's watch: its copy does not fit with the one held.
        let (_ep3, other) = raw_connect(&b).await.unwrap();
        let (mut s2, mut r2) = other.open_bi().await.unwrap();
        s2.write_all(&auth(&b)).await.unwrap();
        let asked = Instant::now();
        s2.write_all(&retained_watch()).await.unwrap();
        match &read_answers(&mut r2, 2).await[1] {
            Message::Error {
                code: Some(ErrorCode::Overloaded),
                ..
            } => {}
            other => panic!("not refused overloaded: {other:?}"),
        }
        assert!(
            asked.elapsed() > Duration::from_secs(2),
            "asked again first"
        );
        // The watcher goes: its copy is given back whole, and a watch starts.
        watcher.close(0u32.into(), b"gone");
        let deadline = Instant::now() + Duration::from_secs(10);
        while b.metric("felix_broker_watch_snapshot_bytes").unwrap() > 0 {
            assert!(Instant::now() < deadline, "the copy is given back");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (mut s3, mut r3) = other.open_bi().await.unwrap();
        s3.write_all(&auth(&b)).await.unwrap();
        s3.write_all(&retained_watch()).await.unwrap();
        match &read_answers(&mut r3, 2).await[1] {
            Message::CacheWatchStarted {
                retained_count: Some(n),
                ..
            } => assert_eq!(*n, count),
            other => panic!("not started: {other:?}"),
        }
        std::mem::forget((s, r, s2, r2, s3, r3));
    });
}

/// A connection that leaves more bytes of answers unread than its bound is closed
/// with error 4 (the broker no longer holds them); one within it is not.
#[test]
fn a_connection_leaving_too_many_answers_unread_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(
        &dir,
        "max_unwritten_answer_bytes_per_connection: 33554432\n",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // About 8 MiB on each shard of a 2-shard stream.
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        for key in 0u64..32 {
            let p = publish("reads", &key.to_be_bytes(), &vec![9u8; 512 << 10], Some(1));
            acked(&conn, auth(&b), p).await;
        }
        // 4 unread 4 MiB answers (JSON: their payloads in base64, 5.3 MiB each):
        // within 32 MiB.
        let (_ep1, within) = unread_reads(&b, "reads", 4).await;
        // 12: 64 MiB, past it.
        let (_ep2, past) = unread_reads(&b, "reads", 12).await;
        tokio::time::timeout(Duration::from_secs(10), past.closed())
            .await
            .expect("the connection past its bound is closed");
        match past.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                assert_eq!(u64::from(c.error_code), 4, "{c:?}")
            }
            other => panic!("closed otherwise: {other:?}"),
        }
        assert!(within.close_reason().is_none(), "within the bound");
        assert_eq!(
            b.metric("felix_broker_unread_answers_closed_total")
                .unwrap(),
            1
        );
        another_client_publishes(&b).await;
    });
}
