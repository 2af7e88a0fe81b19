//! Protocol edges the SDK never exercises: requests before auth, unknown requests with
//! and without `FEATURE_UNSUPPORTED`, oversize pre-auth frames, and the 10 s
//! authentication timeout.

use std::time::{Duration, Instant};

use felix_cluster::{BrokerProcess, raw_connect, read_messages};
use felix_wire::{ErrorCode, Features, Message};

fn broker() -> (BrokerProcess, tempfile::TempDir) {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_felix-broker-under-test"));
    BrokerProcess::start_dev_in_temp_dir(bin, &[]).unwrap()
}

fn auth(b: &BrokerProcess, features: Features) -> bytes::Bytes {
    let (lo, hi) = features.offer();
    Message::Auth {
        tenant_id: "dev".into(),
        token: b.token(),
        client_flags: Some(0x1FFF),
        client_features: lo,
        client_features_hi: hi,
    }
    .to_frame()
}

#[test]
fn protocol_edges() {
    let (b, _dir) = broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();

        // A publish before auth is refused and the stream ends.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        let mut frame = bytes::BytesMut::new();
        felix_wire::PublishBatchHeader {
            tenant: "dev",
            namespace: "default",
            stream: "x",
            ack: None,
            idempotent: None,
            key: None,
        }
        .encode_frame(&mut frame, &[b"early".as_slice()])
        .unwrap();
        s.write_all(&frame).await.unwrap();
        let answers = read_messages(&mut r, 10).await.unwrap();
        assert_eq!(
            answers.len(),
            1,
            "one refusal, then the stream ends: {answers:?}"
        );
        assert!(
            matches!(&answers[0], Some(Message::Error { message, .. }) if message.contains("auth")),
            "{answers:?}"
        );

        // An unknown request with UNSUPPORTED offered is answered and the stream lives on.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b, Features::UNSUPPORTED | Features::ERROR_CODES))
            .await
            .unwrap();
        s.write_all(
            &felix_wire::frame::FrameHeader {
                flags: felix_wire::Flags(0),
                length: 40,
            }
            .to_bytes(),
        )
        .await
        .unwrap();
        s.write_all(br#"{"type":"teleport","request_id":9,"a":1}"#)
            .await
            .unwrap();
        s.write_all(&Message::Topology.to_frame()).await.unwrap();
        s.finish().unwrap();
        let answers = read_messages(&mut r, 10).await.unwrap();
        assert!(
            matches!(answers[0], Some(Message::AuthOk { .. })),
            "{answers:?}"
        );
        assert_eq!(
            answers[1],
            Some(Message::Unsupported {
                request_type: "teleport".into(),
                extension: None,
                request_id: Some(felix_wire::RequestId(9)),
            })
        );
        // The broker names itself in its topology; what matters is that it answered.
        assert!(
            matches!(answers[2], Some(Message::TopologyView { .. })),
            "{}: {answers:?}",
            "the stream kept serving"
        );

        // Without UNSUPPORTED the stream is refused with a coded error and closed.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b, Features::ERROR_CODES)).await.unwrap();
        s.write_all(
            &felix_wire::frame::FrameHeader {
                flags: felix_wire::Flags(0),
                length: 19,
            }
            .to_bytes(),
        )
        .await
        .unwrap();
        s.write_all(br#"{"type":"teleport"}"#).await.unwrap();
        s.write_all(&Message::Topology.to_frame()).await.unwrap();
        let answers = read_messages(&mut r, 10).await.unwrap();
        assert_eq!(
            answers.len(),
            2,
            "auth_ok, the refusal, then nothing: {answers:?}"
        );
        assert!(
            matches!(
                &answers[1],
                Some(Message::Error {
                    code: Some(ErrorCode::InvalidRequest),
                    ..
                })
            ),
            "{answers:?}"
        );

        // A pre-auth frame over 64 KiB ends the stream on its header alone.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(
            &felix_wire::frame::FrameHeader {
                flags: felix_wire::Flags(0),
                length: 70_000,
            }
            .to_bytes(),
        )
        .await
        .unwrap();
        let answers = read_messages(&mut r, 10).await.unwrap();
        assert!(answers.len() <= 1, "{answers:?}");

        // A frame with an unknown flag bit is refused.
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(&auth(&b, Features::ERROR_CODES)).await.unwrap();
        s.write_all(
            &felix_wire::frame::FrameHeader {
                flags: felix_wire::Flags(0x8000),
                length: 2,
            }
            .to_bytes(),
        )
        .await
        .unwrap();
        s.write_all(b"{}").await.unwrap();
        s.write_all(&Message::Topology.to_frame()).await.unwrap();
        s.finish().unwrap();
        let answers = read_messages(&mut r, 10).await.unwrap();
        assert!(
            matches!(
                &answers[1],
                Some(Message::Error {
                    code: Some(ErrorCode::InvalidRequest),
                    ..
                })
            ),
            "{answers:?}"
        );
        // The broker names itself in its topology; what matters is that it answered.
        assert!(
            matches!(answers[2], Some(Message::TopologyView { .. })),
            "{}: {answers:?}",
            "the stream stayed aligned"
        );
    });
}

#[test]
fn a_connection_that_never_authenticates_is_closed_after_ten_seconds() {
    let (b, _dir) = broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_ep, conn) = raw_connect(&b).await.unwrap();
        let started = Instant::now();
        let reason = tokio::time::timeout(Duration::from_secs(20), conn.closed())
            .await
            .unwrap();
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(9), "closed after {waited:?}");
        match reason {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(u64::from(c.error_code), 1, "close code 1");
                assert_eq!(&c.reason[..], b"authentication timeout");
            }
            other => panic!("unexpected close: {other}"),
        }
    });
}

/// Pipelined idempotent publishes that arrive while their shard is still opening (the
/// first requests after a restart) reach the producer table in the order they arrived:
/// queued out of order, a producer's later batch was decided before its first and
/// refused (unknown producer, or a gap), which ends that producer.
#[test]
fn pipelined_idempotent_publishes_right_after_a_restart_are_decided_in_order() {
    use felix_wire::{ProducerId, RequestId, Sequence};
    let (mut b, _dir) = broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let features = Features::ERROR_CODES
        .union(Features::IDEMPOTENT_PRODUCER)
        .union(Features::PUBLISH_PIPELINE);
    let publish = |producer: u64, seq: u64| {
        Message::PublishIdempotent {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: "idem".into(),
            payloads: vec![bytes::Bytes::from(format!("{producer}-{seq}"))],
            key: None,
            shard: None,
            request_id: RequestId(seq + 1),
            producer_id: ProducerId(producer),
            sequence: Sequence(seq),
        }
        .to_frame()
    };
    let send = |b: &BrokerProcess, producer: u64, batches: u64| {
        let frames: Vec<_> = (0..batches).map(|seq| publish(producer, seq)).collect();
        let auth = auth(b, features);
        let listen = b.listen;
        let ca = b.ca_file();
        async move {
            let (_ep, conn) = felix_cluster::raw_connect_to(listen, &ca).await.unwrap();
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            s.write_all(&auth).await.unwrap();
            // One datagram at a time, spread over the shard's open: some arrive while
            // it opens, some just as it is ready, some after.
            for f in &frames {
                s.write_all(f).await.unwrap();
                let until = Instant::now() + Duration::from_micros(150);
                while Instant::now() < until {
                    tokio::task::yield_now().await;
                }
            }
            s.finish().unwrap();
            let answers = read_messages(&mut r, batches as usize + 1).await.unwrap();
            assert_eq!(answers.len() as u64, batches + 1, "{answers:?}");
            answers[1..]
                .iter()
                .filter(|a| !matches!(a, Some(Message::PublishOk { .. })))
                .cloned()
                .collect::<Vec<_>>()
        }
    };
    // The stream's shard gets a log, then every restart closes it.
    assert_eq!(rt.block_on(send(&b, 1, 1)), Vec::new());
    for round in 0..6 {
        b.kill();
        b.restart().unwrap();
        let refused = rt.block_on(send(&b, 100 + round, 200));
        assert!(
            refused.is_empty(),
            "round {round}: refused after the restart: {refused:?}"
        );
    }
}

/// A batch sent again under a sequence the broker holds, but with other records (a
/// producer that reuses sequences, or reset them), is refused, typed, and nothing is
/// written: answered from the log as a re-send, as it was before 2026-12-05 when only
/// the record count was compared, its records were acknowledged and lost. The broker
/// tells batches apart by a digest of their records, also once it rebuilt what it knows
/// of the producer from the log after a restart. A client that does not read
/// `sequence_reused` is told `invalid_request`.
#[test]
fn another_batch_under_a_used_sequence_is_refused_and_nothing_is_written() {
    use felix_wire::{Offset, ProducerId, RequestId, Sequence};
    let (mut b, _dir) = broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reads_reused = Features::ERROR_CODES
        .union(Features::IDEMPOTENT_PRODUCER)
        .union(Features::SEQUENCE_REUSED);
    let publish = |seq: u64, bodies: &[&str]| {
        Message::PublishIdempotent {
            tenant_id: "dev".into(),
            namespace: "default".into(),
            stream: "reuse".into(),
            payloads: bodies
                .iter()
                .map(|s| bytes::Bytes::from(s.to_string()))
                .collect(),
            key: None,
            shard: None,
            request_id: RequestId(seq + 1),
            producer_id: ProducerId(7),
            sequence: Sequence(seq),
        }
        .to_frame()
    };
    // One stream per request, so every answer is read before the next request goes.
    let ask = |b: &BrokerProcess, features: Features, frame: bytes::Bytes| {
        let auth = auth(b, features);
        let (listen, ca) = (b.listen, b.ca_file());
        async move {
            let (_ep, conn) = felix_cluster::raw_connect_to(listen, &ca).await.unwrap();
            let (mut s, mut r) = conn.open_bi().await.unwrap();
            s.write_all(&auth).await.unwrap();
            s.write_all(&frame).await.unwrap();
            s.finish().unwrap();
            let answers = read_messages(&mut r, 2).await.unwrap();
            answers.into_iter().nth(1).flatten()
        }
    };
    let offset = |m: Option<Message>| match m {
        Some(Message::PublishOk {
            offset: Some(Offset(o)),
            ..
        }) => o,
        other => panic!("expected publish_ok with an offset, got {other:?}"),
    };
    let reused = |m: Option<Message>, when: &str| match m {
        Some(Message::PublishRefused {
            reason: felix_wire::message::PublishRefusalReason::SequenceReused,
            ..
        }) => {}
        other => panic!("{when}: expected sequence_reused, got {other:?}"),
    };
    rt.block_on(async {
        assert_eq!(
            offset(ask(&b, reads_reused, publish(0, &["ab", "c"])).await),
            0
        );
        assert_eq!(
            offset(ask(&b, reads_reused, publish(0, &["ab", "c"])).await),
            0,
            "the same batch again is a re-send"
        );
        // Same count and bytes, other records; the same bytes split otherwise.
        for other in [&["ab", "d"][..], &["a", "bc"]] {
            reused(
                ask(&b, reads_reused, publish(0, other)).await,
                &format!("{other:?}"),
            );
        }
        match ask(&b, Features::ERROR_CODES, publish(0, &["ab", "d"])).await {
            Some(Message::PublishError {
                code: Some(ErrorCode::InvalidRequest),
                message,
                ..
            }) => assert!(message.contains("sequence_reused"), "{message}"),
            other => panic!("a client that does not read sequence_reused: {other:?}"),
        }
        assert_eq!(
            offset(ask(&b, reads_reused, publish(1, &["e"])).await),
            2,
            "the refused batches wrote nothing"
        );
    });
    // After a restart the broker knows the producer's batches from the log only.
    b.kill();
    b.restart().unwrap();
    rt.block_on(async {
        assert_eq!(
            offset(ask(&b, reads_reused, publish(0, &["ab", "c"])).await),
            0,
            "the same batch is still a re-send after the restart"
        );
        reused(
            ask(&b, reads_reused, publish(0, &["ab", "d"])).await,
            "after the restart",
        );
        assert_eq!(offset(ask(&b, reads_reused, publish(2, &["f"])).await), 3);
    });
}

/// Writes of one key pipelined on a stream land in the order sent: a conditional write
/// waits for the key's earlier writes before it claims its place, and a put sent after
/// it claimed first, so the condition was checked against a write sent after it (and a
/// delete waiting so removed a later, acknowledged put). See
/// [`felix_cluster::writes_of_one_key_in_order`].
#[test]
fn pipelined_writes_of_one_key_land_in_the_order_sent() {
    let (b, _dir) = broker();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let auth = auth(&b, Features::ERROR_CODES.union(Features::CACHE_CONDITIONAL));
    for round in 0..5 {
        let outcome = rt.block_on(felix_cluster::writes_of_one_key_in_order(
            b.listen,
            &b.ca_file(),
            auth.clone(),
            ("dev", "default", "ordered"),
        ));
        assert_eq!(
            outcome,
            felix_cluster::WRITES_OF_ONE_KEY_IN_ORDER,
            "round {round}"
        );
    }
}
