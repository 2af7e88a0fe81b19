//! Property tests: every JSON message and every binary layout survives encode -> decode
//! unchanged, and arbitrary bytes never panic a decoder.

use bytes::{Bytes, BytesMut};
use felix_wire::binary::AckCode;
use felix_wire::frame::{Decoded, decode_frame};
use felix_wire::{
    AckMode, AckPrefix, ErrorCode, EventBatch, EventItem, Flags, FrameReader, Generation,
    IdempotentPrefix, Message, Offset, OwnerHint, ProducerId, PublishAck, PublishAckStatus,
    PublishBatch, PublishBatchHeader, RequestId, RetryClass, Sequence, SubscriptionId, WireStr,
};
use proptest::prelude::*;
use serde_json::{Value, json};

/// One instance of every message type, every optional field present.
fn templates() -> Vec<Value> {
    let scope = |extra: Value| {
        let mut v = json!({"tenant_id":"t","namespace":"n","stream":"s","shard":1,"group":"g","request_id":1});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let mut t = vec![
        json!({"type":"auth","tenant_id":"t","token":"x","client_flags":25,"client_features":7,"client_features_hi":1}),
        json!({"type":"auth_ok","server_flags":25,"server_features":7,"server_features_hi":1,"listener_ports":[5001],"publish_window":256}),
        json!({"type":"ok"}),
        json!({"type":"error","message":"m","code":"not_found","retry":"retry_after","detail":{"reason":"r","retry_after_ms":5}}),
        json!({"type":"unsupported","request_type":"x","extension":"e","request_id":3}),
        json!({"type":"extension","name":"e","request_id":3,"body":{"a":[1,2]}}),
        json!({"type":"topology"}),
        json!({"type":"topology_view","brokers":[{"node_id":"a","addr":"127.0.0.1:5000"}]}),
        json!({"type":"not_leader","node_id":"a","addr":"h:1","generation":4}),
        json!({"type":"stream_shards","tenant_id":"t","namespace":"n","stream":"s","request_id":1}),
        json!({"type":"stream_shards_view","shards":4,"request_id":1,"routing":"jump_hash"}),
        json!({"type":"cache_shards","tenant_id":"t","namespace":"n","cache":"c","request_id":1}),
        json!({"type":"cache_shards_view","shards":4,"request_id":1}),
        json!({"type":"shard_owners","tenant_id":"t","namespace":"n","name":"s","kind":"cache","request_id":1}),
        json!({"type":"shard_owners_view","owners":[{"shard":0,"node_id":"a","addr":"h:1","generation":2,"unavailable":"owner_unavailable"}],"request_id":1}),
        json!({"type":"publish","tenant_id":"t","namespace":"n","stream":"s","payload":"aGk=","key":"aw==","shard":2,"request_id":1,"ack":"per_message"}),
        json!({"type":"publish_batch","tenant_id":"t","namespace":"n","stream":"s","payloads":["aGk=",""],"key":"","shard":2,"request_id":1,"ack":"per_batch"}),
        json!({"type":"publish_ok","request_id":1,"offset":9}),
        json!({"type":"publish_error","request_id":1,"message":"m","code":"storage","retry":"outcome_unknown","detail":{"reason":"r"}}),
        json!({"type":"producer_init","request_id":1}),
        json!({"type":"producer_init_ok","request_id":1,"producer_id":99}),
        json!({"type":"publish_idempotent","tenant_id":"t","namespace":"n","stream":"s","payloads":["aGk="],"key":"aw==","shard":0,"request_id":1,"producer_id":9,"sequence":3}),
        json!({"type":"publish_if","tenant_id":"t","namespace":"n","stream":"s","payloads":["aGk="],"key":"aw==","shard":0,"expected_offset":5,"request_id":1}),
        json!({"type":"publish_refused","request_id":1,"reason":{"sequence_gap":{"expected":4}},"message":"m"}),
        json!({"type":"publish_refused","request_id":1,"reason":"sequence_reused","message":"m"}),
        json!({"type":"publish_refused","request_id":1,"reason":{"not_leader":{"node_id":"a","addr":"h:1"}},"message":"m"}),
        json!({"type":"subscribe","tenant_id":"t","namespace":"n","stream":"s","subscription_id":4,"start":{"offset":5},"shard":1,"queue_capacity":64}),
        json!({"type":"subscribe","tenant_id":"t","namespace":"n","stream":"s","start":"earliest"}),
        json!({"type":"subscribed","subscription_id":4,"start_offset":5,"live_offset":9,"queue_capacity":64}),
        json!({"type":"subscribe_cursor_error","reason":"too_old","requested":1,"available":5}),
        json!({"type":"event_stream_hello","subscription_id":4}),
        json!({"type":"shard_moved","subscription_id":4,"resume_from":5,"node_id":"b","addr":"h:2","generation":7}),
        json!({"type":"stream_deleted","subscription_id":4}),
        json!({"type":"subscription_lagged","subscription_id":4,"resume_from":5}),
        json!({"type":"event","tenant_id":"t","namespace":"n","stream":"s","payload":"aGk=","offset":3}),
        json!({"type":"event_batch","tenant_id":"t","namespace":"n","stream":"s","payloads":["aGk="],"base_offset":3}),
        json!({"type":"stream_read","tenant_id":"t","namespace":"n","stream":"s","shard":0,"from":1,"end":9,"max_records":10,"max_bytes":100,"request_id":1}),
        json!({"type":"stream_records","records":[{"offset":1,"payload":"aGk=","publisher":"p","timestamp_micros":5}],"next_offset":2,"request_id":1}),
        json!({"type":"offset_for_time","tenant_id":"t","namespace":"n","stream":"s","shard":0,"at_micros":5,"request_id":1}),
        json!({"type":"offset_value","offset":3,"request_id":1}),
        json!({"type":"cache_put","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":"aGk=","request_id":1,"ttl_ms":1000}),
        json!({"type":"cache_get","tenant_id":"t","namespace":"n","cache":"c","key":"k","request_id":1}),
        json!({"type":"cache_delete","tenant_id":"t","namespace":"n","cache":"c","key":"k","request_id":1}),
        json!({"type":"cache_value","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":"aGk=","request_id":1,"version":4}),
        json!({"type":"cache_value","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":null}),
        json!({"type":"cache_ok","request_id":1}),
        json!({"type":"cache_put_if","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":"aGk=","ttl_ms":5,"condition":{"version":3},"request_id":1}),
        json!({"type":"cache_put_if","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":"aGk=","condition":"absent","request_id":1}),
        json!({"type":"cache_delete_if","tenant_id":"t","namespace":"n","cache":"c","key":"k","version":3,"request_id":1}),
        json!({"type":"cache_condition_result","applied":true,"version":3,"request_id":1}),
        json!({"type":"cache_watch","tenant_id":"t","namespace":"n","cache":"c","key":"k","prefix":"p","shard":1,"from_offset":3,"retained":true,"subscription_id":4}),
        json!({"type":"cache_watch_started","subscription_id":4,"resume_offset":3,"resnapshot":true,"retained_count":2}),
        json!({"type":"cache_event","key":"k","value":"aGk=","offset":3,"expires_at_millis":0}),
        json!({"type":"cache_watch_lagged","resume_from":3}),
        json!({"type":"counter_add","tenant_id":"t","namespace":"n","cache":"c","key":"k","delta":-5,"request_id":1}),
        json!({"type":"counter_get","tenant_id":"t","namespace":"n","cache":"c","key":"k","request_id":1}),
        json!({"type":"counter_value","value":-5,"request_id":1}),
        json!({"type":"commit","tenant_id":"t","namespace":"n","stream":"s","entity_key":"ZQ==","event":"aGk=","changes":[{"op":"put","key":"k","value":"aGk="},{"op":"delete","key":"j"}],"request_id":1,"expected_offset":2}),
        json!({"type":"commit_ok","request_id":1,"offset":3}),
        json!({"type":"state_get","tenant_id":"t","namespace":"n","stream":"s","entity_key":"ZQ==","key":"k","request_id":1}),
        json!({"type":"state_value","value":"aGk=","version":2,"as_of":3,"request_id":1}),
        json!({"type":"group_records","records":[{"offset":1,"payload":"aGk=","attempts":1,"skipped_before":2,"publisher":"p","timestamp_micros":9}],"request_id":1}),
        json!({"type":"group_extended","visible_ms":5,"request_id":1}),
        json!({"type":"group_dead_letter_list","offsets":[1,2],"request_id":1}),
        json!({"type":"group_position","offset":1,"moved":true,"request_id":1}),
        json!({"type":"group_info","committed":1,"tail":5,"in_flight":1,"owed":2,"dead_letters":0,"request_id":1}),
        json!({"type":"group_deleted","existed":true,"request_id":1}),
        json!({"type":"shard_inspect","tenant_id":"t","namespace":"n","name":"s","kind":"stream","shard":0,"request_id":1}),
        json!({"type":"shard_inspect_info","view":{"node_id":"a"},"request_id":1}),
        json!({"type":"subscriptions_list","filter":{"tenant_id":"t"},"limit":10,"cursor":"c","request_id":1}),
        json!({"type":"subscriptions_list_info","node_id":"a","subscriptions":[{"x":1}],"next_cursor":"c","request_id":1}),
    ];
    t.push(json!({"type":"group_poll"}));
    t.last_mut().unwrap().as_object_mut().unwrap().extend(
        scope(
            json!({"max_records":10,"wait_ms":5,"consumer":"c","reclaim":true,"visibility_ms":100}),
        )
        .as_object()
        .unwrap()
        .clone(),
    );
    for (ty, extra) in [
        ("group_ack", json!({"offset":3})),
        ("group_nack", json!({"offset":3,"delay_ms":5,"attempts":2})),
        (
            "group_extend",
            json!({"offset":3,"attempts":2,"extend_ms":100}),
        ),
        ("group_dead_letter", json!({"offset":3})),
        ("group_dead_letters", json!({})),
        ("group_discard", json!({"offset":3})),
        ("group_redrive", json!({"offset":3})),
        ("group_seek", json!({"start":"latest","if_new":true})),
        ("group_describe", json!({})),
        ("group_delete", json!({})),
    ] {
        let mut v = scope(extra);
        v["type"] = json!(ty);
        t.push(v);
    }
    t
}

const FREE_TEXT: &[&str] = &[
    "tenant_id",
    "namespace",
    "stream",
    "cache",
    "key",
    "message",
    "node_id",
    "addr",
    "group",
    "name",
    "token",
    "consumer",
    "prefix",
    "request_type",
    "extension",
    "cursor",
    "publisher",
];
const BASE64: &[&str] = &["payload", "value", "event", "payloads", "entity_key"];

/// Replaces free-text and byte leaves of a template with arbitrary values drawn from
/// `seed`, keeping numbers and enum names valid.
fn perturb(v: &mut Value, key: Option<&str>, rng: &mut proptest::test_runner::TestRng) {
    // A publish's routing key is bytes (base64); a cache key is text.
    let binary_key = v
        .get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| t.starts_with("publish"));
    perturb_leaf(v, key, binary_key, rng)
}

fn perturb_leaf(
    v: &mut Value,
    key: Option<&str>,
    binary_key: bool,
    rng: &mut proptest::test_runner::TestRng,
) {
    use base64::Engine;
    use rand::RngExt;
    match v {
        Value::Object(map) => {
            let is_enum_holder = matches!(key, Some("reason") | Some("condition") | Some("start"));
            for (k, child) in map.iter_mut() {
                if is_enum_holder && k != "node_id" && k != "addr" {
                    continue;
                }
                perturb_leaf(child, Some(k), binary_key, rng);
            }
        }
        Value::Array(items) => {
            for item in items {
                perturb_leaf(item, key, binary_key, rng);
            }
        }
        Value::String(s) => {
            let k = key.unwrap_or("");
            if BASE64.contains(&k) || (binary_key && k == "key") {
                let len = rng.random_range(0..64);
                let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                *s = base64::engine::general_purpose::STANDARD.encode(bytes);
            } else if FREE_TEXT.contains(&k) {
                let len = rng.random_range(0..16);
                *s = (0..len)
                    .map(|_| char::from_u32(rng.random_range(0..0x2_0000)).unwrap_or('\u{fffd}'))
                    .collect();
            }
        }
        Value::Number(n) if n.is_u64() && key != Some("delta") => {
            // The narrowest numeric fields are u16.
            *v = json!(rng.random_range(0..=u64::from(u16::MAX)));
        }
        _ => {}
    }
}

#[test]
fn templates_cover_every_message_type() {
    for t in templates() {
        let m = Message::decode(t.to_string().as_bytes()).unwrap_or_else(|e| panic!("{t}: {e}"));
        assert!(!matches!(m, Message::Unknown), "{t}");
        // Everything in the template survives: no field is silently dropped.
        let back: Value = serde_json::from_slice(&m.to_payload()).unwrap();
        assert_eq!(back, t, "template round trip");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_message_round_trips(index in 0usize..80, seed in any::<u64>()) {
        let all = templates();
        let mut v = all[index % all.len()].clone();
        let mut rng = proptest::test_runner::TestRng::from_seed(
            proptest::test_runner::RngAlgorithm::ChaCha,
            &{
                let mut s = [0u8; 32];
                s[..8].copy_from_slice(&seed.to_le_bytes());
                s
            },
        );
        perturb(&mut v, None, &mut rng);
        let m = Message::decode(v.to_string().as_bytes()).unwrap();
        let mut buf = BytesMut::new();
        m.encode_frame(&mut buf).unwrap();
        let Decoded::Complete { value: frame, .. } = decode_frame(&buf.clone().freeze(), u32::MAX).unwrap() else {
            panic!("whole frame")
        };
        prop_assert_eq!(Message::decode(&frame.payload).unwrap(), m);
    }

    #[test]
    fn publish_batches_round_trip(
        tenant in ".{0,20}", namespace in ".{0,20}", stream in ".{0,20}",
        acked in any::<Option<(u64, bool)>>(),
        idem in any::<Option<(u64, u64)>>(),
        key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
        payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..20),
    ) {
        let ack = acked.map(|(id, per_batch)| AckPrefix {
            request_id: RequestId(id),
            ack_mode: if per_batch || idem.is_some() { AckMode::PerBatch } else { AckMode::PerMessage },
        });
        let idempotent = if ack.is_some() {
            idem.map(|(p, s)| IdempotentPrefix { producer_id: ProducerId(p), sequence: Sequence(s) })
        } else {
            None
        };
        let header = PublishBatchHeader {
            tenant: &tenant, namespace: &namespace, stream: &stream, ack, idempotent,
            key: key.as_deref(),
        };
        let mut buf = BytesMut::new();
        header.encode_frame(&mut buf, &payloads).unwrap();
        let Decoded::Complete { value: frame, consumed } = decode_frame(&buf.freeze(), u32::MAX).unwrap() else {
            panic!("whole frame")
        };
        prop_assert_eq!(frame.flags, header.flags());
        let batch = PublishBatch::decode(frame.flags, &frame.payload).unwrap();
        prop_assert_eq!(consumed, 12 + frame.payload.len());
        prop_assert_eq!(batch.tenant.as_str(), tenant.as_str());
        prop_assert_eq!(batch.namespace.as_str(), namespace.as_str());
        prop_assert_eq!(batch.stream.as_str(), stream.as_str());
        prop_assert_eq!(batch.ack, ack);
        prop_assert_eq!(batch.idempotent, idempotent);
        prop_assert_eq!(batch.key.as_deref(), key.as_deref());
        prop_assert_eq!(batch.payloads.iter().map(|p| p.to_vec()).collect::<Vec<_>>(), payloads);
    }

    #[test]
    fn publish_acks_round_trip(
        ok in any::<bool>(), request_id in any::<u64>(), message in ".{0,40}",
        code in 0u16..20, retry in 1u8..6, detail in proptest::option::of((".{0,20}", any::<u64>())),
        owner in proptest::option::of((".{0,10}", proptest::option::of("[a-z0-9:.]{1,20}"), any::<u64>())),
        offset in proptest::option::of(any::<u64>()),
    ) {
        let ack = PublishAck {
            status: if ok { PublishAckStatus::Ok } else { PublishAckStatus::Error },
            request_id: RequestId(request_id),
            message: if ok { String::new() } else { message },
            code: (!ok).then(|| AckCode {
                code: ErrorCode::from_number(code),
                retry: RetryClass::from_byte(retry),
                detail,
            }),
            owner: owner.map(|(node_id, addr, g)| OwnerHint { node_id, addr, generation: Generation(g) }),
            first_offset: if ok { offset.map(Offset) } else { None },
        };
        let mut buf = BytesMut::new();
        ack.encode_frame(&mut buf, Flags::KNOWN).unwrap();
        let Decoded::Complete { value: frame, .. } = decode_frame(&buf.freeze(), u32::MAX).unwrap() else {
            panic!("whole frame")
        };
        prop_assert_eq!(PublishAck::decode(frame.flags, &frame.payload).unwrap(), ack);
    }

    #[test]
    fn event_batches_round_trip(
        sub in proptest::option::of(any::<u64>()),
        base in proptest::option::of(any::<u64>()),
        skipped in proptest::option::of(any::<u64>()),
        publisher in proptest::option::of("[a-zA-Z0-9@._-]{0,60}"),
        timestamps in any::<bool>(),
        events in proptest::collection::vec((any::<u64>(), proptest::collection::vec(any::<u8>(), 0..200)), 0..20),
    ) {
        let batch = EventBatch {
            subscription_id: sub.map(SubscriptionId),
            base_offset: base.map(Offset),
            skipped_before: if base.is_some() { skipped } else { None },
            publisher: publisher.map(WireStr::from),
            timestamps,
            events: events
                .into_iter()
                .map(|(ts, p)| EventItem { timestamp_micros: timestamps.then_some(ts), payload: Bytes::from(p) })
                .collect(),
        };
        let mut buf = BytesMut::new();
        batch.encode_frame(&mut buf).unwrap();
        let Decoded::Complete { value: frame, .. } = decode_frame(&buf.freeze(), u32::MAX).unwrap() else {
            panic!("whole frame")
        };
        prop_assert_eq!(EventBatch::decode(frame.flags, &frame.payload).unwrap(), batch);
    }

    #[test]
    fn arbitrary_bytes_never_panic_any_decoder(
        flags in any::<u16>(),
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        felix_wire_fuzz_targets::all(&bytes);
        let payload = Bytes::from(bytes.clone());
        let _ = PublishBatch::decode(Flags(flags), &payload);
        let _ = PublishAck::decode(Flags(flags), &payload);
        let _ = EventBatch::decode(Flags(flags), &payload);
        let _ = Message::decode(&bytes);
        let mut reader = FrameReader::new(1024);
        reader.push(payload);
        while let Ok(Some(_)) = reader.next_frame() {}
    }
}

/// The same entry points the cargo-fuzz targets call (see `wire/fuzz`).
mod felix_wire_fuzz_targets {
    pub fn all(data: &[u8]) {
        felix_wire::fuzzing::frames(data);
        felix_wire::fuzzing::json_message(data);
        felix_wire::fuzzing::binary_layouts(data);
        felix_wire::fuzzing::internal(data);
    }
}
