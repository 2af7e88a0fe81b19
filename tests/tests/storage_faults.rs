//! Storage failures under a running broker: a failed fdatasync poisons the shard's log
//! (typed refusals, `/readyz` unready, nothing acknowledged lost across a restart); a
//! full disk refuses appends with a typed retryable error and takes them again once
//! space is freed, without a restart. Faults come through the broker's storage fault
//! seam (`/debug/storage-faults`) and, as root, from a really full loop-mounted ext4.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use felix_client::{Client, ClientConfig, ClientError};
use felix_cluster::{BrokerProcess, LoopFs, wait_for};
use felix_wire::message::StartPosition;
use felix_wire::{AckMode, ErrorCode};

fn start(data: &Path, config: &str, extra: &[&str]) -> BrokerProcess {
    let path = data.with_extension("yaml");
    std::fs::write(&path, config).unwrap();
    let mut args = vec!["--config", path.to_str().unwrap(), "--fsync", "on-commit"];
    args.extend_from_slice(extra);
    BrokerProcess::start_dev(
        Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test")),
        data,
        &args,
    )
    .unwrap()
}

async fn client(b: &BrokerProcess) -> Client {
    let quinn = felix_client::quic_client_config_from_file(&b.ca_file(), false).unwrap();
    let mut config = ClientConfig::from_env_or_yaml(quinn, None).unwrap();
    config.auth_tenant_id = Some("dev".to_string());
    config.auth_token = Some(b.token());
    Client::connect(b.listen, "localhost", config)
        .await
        .unwrap()
}

async fn publish(c: &Client, payload: &[u8]) -> Result<u64, ClientError> {
    c.publish("dev", "default", "s", payload.to_vec(), AckMode::PerMessage)
        .await
        .map(|o| o.expect("acks carry offsets"))
}

/// Every record of the stream, by offset.
async fn read_all(c: &Client, n: usize) -> Vec<(u64, Vec<u8>)> {
    let mut sub = c
        .subscribe_from("dev", "default", "s", Some(StartPosition::Earliest))
        .await
        .unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(Duration::from_secs(5), sub.next_event()).await {
            Ok(Ok(Some(e))) => out.push((e.offset.unwrap(), e.payload.to_vec())),
            _ => break,
        }
    }
    out
}

fn arm(b: &BrokerProcess, query: &str) {
    let (status, body) = b
        .http_post(&format!("/debug/storage-faults?{query}"))
        .unwrap();
    assert_eq!(status, 200, "{body}");
}

fn readyz(b: &BrokerProcess) -> (u16, String) {
    b.http_get("/readyz").unwrap()
}

fn code(e: &ClientError) -> Option<ErrorCode> {
    match e {
        ClientError::Broker(b) => b.code.clone(),
        _ => None,
    }
}

#[test]
fn a_failed_fsync_poisons_the_log_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut b = start(&data, "fault_injection: true\n", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let acked = rt.block_on(async {
        let c = client(&b).await;
        let mut acked = Vec::new();
        for i in 0..50u32 {
            let p = format!("r{i}");
            acked.push((publish(&c, p.as_bytes()).await.unwrap(), p.into_bytes()));
        }
        arm(&b, "op=sync&errno=eio&times=once");
        let e = publish(&c, b"doomed").await.unwrap_err();
        assert_eq!(code(&e), Some(ErrorCode::Storage), "{e}");
        let e = publish(&c, b"after").await.unwrap_err();
        assert_eq!(
            code(&e),
            Some(ErrorCode::Storage),
            "refused until restart: {e}"
        );
        acked
    });
    let (status, body) = wait_for("/readyz to turn unready", Duration::from_secs(5), || {
        let r = readyz(&b);
        (r.0 == 503).then_some(r)
    })
    .unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("poisoned"), "{body}");
    b.restart().unwrap();
    assert_eq!(readyz(&b).0, 200, "recovery reads what reached the disk");
    rt.block_on(async {
        let c = client(&b).await;
        let got = read_all(&c, acked.len() + 2).await;
        assert!(got.len() >= acked.len());
        for (i, (o, p)) in acked.iter().enumerate() {
            assert_eq!(got[i], (*o, p.clone()), "acknowledged record {i} intact");
        }
        publish(&c, b"again").await.unwrap();
    });
}

#[test]
fn a_full_disk_refuses_appends_and_recovers_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let b = start(&dir.path().join("data"), "fault_injection: true\n", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client(&b).await;
        let mut acked = Vec::new();
        for i in 0..20u32 {
            let p = format!("r{i}");
            acked.push((publish(&c, p.as_bytes()).await.unwrap(), p.into_bytes()));
        }
        arm(&b, "op=write&errno=enospc&times=always");
        for _ in 0..3 {
            let e = publish(&c, b"no room").await.unwrap_err();
            assert_eq!(code(&e), Some(ErrorCode::Overloaded), "{e}");
        }
        let (status, body) = readyz(&b);
        assert_eq!(status, 503);
        assert!(body.contains("disk full"), "{body}");
        arm(&b, "clear=true");
        // Ready again with no append to say so: only a later append on the core
        // cleared it, and a broker that balancers took out got none.
        wait_for("/readyz to turn ready", Duration::from_secs(10), || {
            (readyz(&b).0 == 200).then_some(())
        })
        .unwrap();
        for i in 20..30u32 {
            let p = format!("r{i}");
            acked.push((publish(&c, p.as_bytes()).await.unwrap(), p.into_bytes()));
        }
        assert_eq!(readyz(&b).0, 200, "ready again, no restart");
        let got = read_all(&c, acked.len() + 1).await;
        assert_eq!(
            got, acked,
            "every acknowledged record, contiguous, nothing refused"
        );
    });
}

#[test]
fn a_really_full_filesystem_refuses_appends_until_space_is_freed() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = LoopFs::mount(dir.path(), 48) else {
        eprintln!("SKIPPED: needs root and a loop device to mount a small ext4");
        return;
    };
    let data = fs.mount.join("data");
    // Small segments, so a full disk is met when the log rolls into a new one.
    let b = start(&data, "segment_bytes: 2097152\n", &[]);
    // Fill what is left but a little, with a file the test can remove.
    let filler = fs.mount.join("filler");
    let avail = {
        let out = Command::new("df")
            .args(["--output=avail", "-B1"])
            .arg(&fs.mount)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let ok = Command::new("fallocate")
        .arg("-l")
        .arg((avail.saturating_sub(6 << 20)).to_string())
        .arg(&filler)
        .status()
        .unwrap()
        .success();
    assert!(ok, "filling the filesystem");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client(&b).await;
        let payload = vec![b'x'; 64 * 1024];
        let mut acked = Vec::new();
        let mut refused = None;
        for _ in 0..400 {
            match publish(&c, &payload).await {
                Ok(o) => acked.push(o),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let e = refused.expect("the filesystem fills up");
        assert_eq!(
            code(&e),
            Some(ErrorCode::Overloaded),
            "typed and retryable: {e}"
        );
        eprintln!(
            "disk full after {} acknowledged 64 KiB records",
            acked.len()
        );
        let (status, body) = readyz(&b);
        assert_eq!(status, 503, "{body}");
        std::fs::remove_file(&filler).unwrap();
        // Appends resume by themselves.
        let next = publish(&c, &payload).await.expect("space was freed");
        assert_eq!(
            next,
            acked.last().map_or(0, |o| o + 1),
            "offsets stay contiguous"
        );
        acked.push(next);
        assert_eq!(readyz(&b).0, 200);
        let got = read_all(&c, acked.len() + 1).await;
        let offsets: Vec<u64> = got.iter().map(|(o, _)| *o).collect();
        assert_eq!(offsets, acked, "every acknowledged record, nothing more");
    });
    drop(b);
}

/// A full disk gives back the offsets of an idempotent batch whose answer waits behind
/// another (a group poll on its stream): the producer's next batch, sent meanwhile on
/// another connection, is refused `sequence_gap` (expected the lost one), not appended
/// ahead of it, and the lost one's re-send then lands before it. The producer table
/// kept the lost batch until its answer was sent.
#[test]
fn a_batch_lost_to_a_full_disk_is_not_overtaken_by_the_next() {
    use felix_wire::message::PublishRefusalReason;
    use felix_wire::{Message, ProducerId, RequestId, Sequence, ShardId};
    let dir = tempfile::tempdir().unwrap();
    let b = start(&dir.path().join("data"), "fault_injection: true\n", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let auth = felix_cluster::raw_auth("dev", &b.token());
        let idempotent = |sequence: u64, request: u64| {
            Message::PublishIdempotent {
                tenant_id: "dev".into(),
                namespace: "default".into(),
                stream: "s".into(),
                payloads: vec![bytes::Bytes::from(format!("p{sequence}"))],
                key: None,
                shard: Some(ShardId(0)),
                request_id: RequestId(request),
                producer_id: ProducerId(42),
                sequence: Sequence(sequence),
            }
            .to_frame()
        };
        let poll = |shard: u32, wait_ms: u64| {
            Message::GroupPoll {
                tenant_id: "dev".into(),
                namespace: "default".into(),
                stream: "q".into(),
                shard: ShardId(shard),
                group: "g".into(),
                max_records: 1000,
                wait_ms,
                request_id: RequestId(9),
                consumer: None,
                reclaim: false,
                visibility_ms: Some(120_000),
            }
            .to_frame()
        };
        let answers = |r: quinn::RecvStream, n: usize| async move {
            let mut r = r;
            tokio::time::timeout(
                Duration::from_secs(20),
                felix_cluster::read_messages(&mut r, n),
            )
            .await
            .expect("answered")
            .unwrap()
        };
        let (_ep, conn) = felix_cluster::raw_connect(&b).await.unwrap();
        // A group with nothing to hand out: one record on each shard of `q`, claimed.
        for shard in 0..2u32 {
            let (mut s, r) = conn.open_bi().await.unwrap();
            s.write_all(&auth).await.unwrap();
            let record = felix_cluster::raw_publish(
                ("dev", "default", "q"),
                format!("k{shard}").as_bytes(),
                b"only",
                Some(1),
            );
            s.write_all(&record).await.unwrap();
            answers(r, 2).await;
        }
        for shard in 0..2u32 {
            let (mut s, r) = conn.open_bi().await.unwrap();
            s.write_all(&auth).await.unwrap();
            s.write_all(&poll(shard, 0)).await.unwrap();
            answers(r, 2).await;
        }
        // Batch 0 lands.
        let (mut s, r) = conn.open_bi().await.unwrap();
        s.write_all(&auth).await.unwrap();
        s.write_all(&idempotent(0, 1)).await.unwrap();
        let got = answers(r, 2).await;
        assert!(matches!(got[1], Some(Message::PublishOk { .. })), "{got:?}");
        // Batch 1's write meets a full disk; its answer waits behind a poll.
        arm(&b, "op=write&errno=enospc&times=once");
        let (mut s1, r1) = conn.open_bi().await.unwrap();
        s1.write_all(&auth).await.unwrap();
        s1.write_all(&poll(0, 3_000)).await.unwrap();
        s1.write_all(&idempotent(1, 2)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        // Batch 2 from elsewhere: refused, the gap named.
        let (_ep2, other) = felix_cluster::raw_connect(&b).await.unwrap();
        let (mut s2, r2) = other.open_bi().await.unwrap();
        s2.write_all(&auth).await.unwrap();
        s2.write_all(&idempotent(2, 3)).await.unwrap();
        let got = answers(r2, 2).await;
        assert!(
            matches!(
                &got[1],
                Some(Message::PublishRefused {
                    reason: PublishRefusalReason::SequenceGap {
                        expected: Sequence(1)
                    },
                    ..
                })
            ),
            "batch 2 went ahead of the lost batch 1: {got:?}"
        );
        let got = answers(r1, 3).await;
        assert!(
            !matches!(got[2], Some(Message::PublishOk { .. })),
            "batch 1 met the full disk: {got:?}"
        );
        // Re-sent, batch 1 lands, then batch 2, in order.
        let mut offsets = Vec::new();
        for (sequence, request) in [(1, 4), (2, 5)] {
            let (mut s, r) = conn.open_bi().await.unwrap();
            s.write_all(&auth).await.unwrap();
            s.write_all(&idempotent(sequence, request)).await.unwrap();
            let got = answers(r, 2).await;
            match &got[1] {
                Some(Message::PublishOk {
                    offset: Some(o), ..
                }) => offsets.push(o.0),
                other => panic!("batch {sequence}: {other:?}"),
            }
        }
        assert!(offsets[0] < offsets[1], "{offsets:?}");
    });
}

/// After a restart the first idempotent batch of a shard taking a steady stream of
/// other writes is answered at once: the producer table is built up to the claims made
/// while it had none (they hold no producer's batch) and covers the rest. It read on
/// until the log's end stood still with nothing in flight, which under load it never
/// did: the batch waited (and then failed `not_ready`). A re-send of a batch from
/// before the restart is answered where it landed, so a table that covered the log
/// without reading it fails here too.
#[test]
fn an_idempotent_batch_is_answered_after_a_restart_under_other_writes() {
    use felix_wire::{Message, ProducerId, RequestId, Sequence, ShardId};
    let dir = tempfile::tempdir().unwrap();
    let mut b = start(&dir.path().join("data"), "", &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let batch = |sequence: u64| {
        Message::PublishIdempotent {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: "s".into(),
            payloads: vec![bytes::Bytes::from(format!("once {sequence}"))],
            key: None,
            shard: Some(ShardId(0)),
            request_id: RequestId(1),
            producer_id: ProducerId(7),
            sequence: Sequence(sequence),
        }
        .to_frame()
    };
    // Sends `batch` on a stream of its own; its publish_ok's offset, within 4 s.
    async fn landed(conn: &quinn::Connection, auth: &[u8], batch: bytes::Bytes) -> u64 {
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(auth).await.unwrap();
        s.write_all(&batch).await.unwrap();
        let got = tokio::time::timeout(
            Duration::from_secs(4),
            felix_cluster::read_messages(&mut r, 2),
        )
        .await
        .expect("the batch is answered while the other writes go on")
        .unwrap();
        match &got[1] {
            Some(Message::PublishOk {
                offset: Some(o), ..
            }) => o.0,
            other => panic!("{other:?}"),
        }
    }
    let first = rt.block_on(async {
        let c = client(&b).await;
        for i in 0..200u32 {
            publish(&c, format!("before {i}").as_bytes()).await.unwrap();
        }
        let auth = felix_cluster::raw_auth("dev", &b.token());
        let (_ep, conn) = felix_cluster::raw_connect(&b).await.unwrap();
        landed(&conn, &auth, batch(0)).await
    });
    b.restart().unwrap();
    rt.block_on(async {
        let auth = felix_cluster::raw_auth("dev", &b.token());
        let (_ep, conn) = felix_cluster::raw_connect(&b).await.unwrap();
        // Pipelined plain publishes to every shard, for as long as the test runs.
        let (mut load, mut acks) = conn.open_bi().await.unwrap();
        load.write_all(&auth).await.unwrap();
        let writer = tokio::spawn(async move {
            for i in 0u64.. {
                let p = felix_cluster::raw_publish(
                    ("dev", "default", "s"),
                    format!("k{}", i % 64).as_bytes(),
                    b"load",
                    Some(i),
                );
                if load.write_all(&p).await.is_err() {
                    break;
                }
            }
        });
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(Some(_)) = acks.read(&mut buf).await {}
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The table is read from the log (the re-send of batch 0 is answered where it
        // landed before the restart, not appended again), then covers the load.
        assert_eq!(
            landed(&conn, &auth, batch(0)).await,
            first,
            "batch 0 landed once"
        );
        assert!(landed(&conn, &auth, batch(1)).await > first);
        writer.abort();
        reader.abort();
    });
}
